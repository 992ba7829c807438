// Package meter is billing's pure core: it turns a released allocation into
// the usage records that bill it, one per segment, priced from the price
// book. The records depend only on the input, so metering the same release
// twice yields the same records, IDs and bodies alike.
//
// Time: a run is billed over the whole seconds it touched,
// [floor(StartedAt), ceil(EndedAt)), cut into segments at every UTC
// midnight (so days and months are sums of whole records) and at every
// price change (so each segment has one price).
//
// Money: each segment's GPU, CPU and memory costs are computed exactly as
// fractions and each is rounded half to even to the micro-unit; the
// record's cost is their sum.
package meter

import (
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// ErrMalformed is returned (wrapped) for a released entry that claims a run
// but cannot be billed as it stands; retrying cannot fix it.
var ErrMalformed = errors.New("malformed ledger entry")

// Node is what billing knows of a node from its latest inventory.
type Node struct {
	Pool  string
	Class contracts.PriceClass
	// GPUMemoryMiB is each GPU's framebuffer by UUID, to price fractions.
	GPUMemoryMiB map[string]int64
}

// Input is one release to meter.
type Input struct {
	Entry contracts.LedgerEntry
	Node  Node
	Book  contracts.PriceBook
	// From and Segment resume an allocation already billed in part:
	// metering starts at From (zero: at the run's start) with segment
	// number Segment.
	From    time.Time
	Segment int
	// CPUMilli and MemoryMiB are the job's request, billed when the
	// version in effect has CPU or memory rates.
	CPUMilli, MemoryMiB int64
}

// Span returns the whole seconds a released entry bills,
// [floor(start), ceil(end)), and false when it bills nothing (a commit, a
// run that never started, a run of no time at all).
func Span(e contracts.LedgerEntry) (start, end time.Time, ok bool, err error) {
	if e.Kind != contracts.LedgerReleased || e.Run == nil || e.Run.StartedAt.IsZero() {
		return time.Time{}, time.Time{}, false, nil
	}
	a := e.Allocation
	var problems []string
	if a.ID == "" {
		problems = append(problems, "no allocation ID")
	}
	if err := contracts.ValidateTenant(a.Tenant); err != nil {
		problems = append(problems, err.Error())
	}
	if len(a.Devices) == 0 {
		problems = append(problems, "no devices")
	}
	if e.Run.EndedAt.Before(e.Run.StartedAt) {
		problems = append(problems, fmt.Sprintf("run ended at %s, before it started at %s", e.Run.EndedAt, e.Run.StartedAt))
	}
	if len(problems) > 0 {
		return time.Time{}, time.Time{}, false, fmt.Errorf("%w: allocation %q: %s", ErrMalformed, a.ID, strings.Join(problems, "; "))
	}
	start, end = Floor(e.Run.StartedAt), Ceil(e.Run.EndedAt)
	return start, end, end.After(start), nil
}

// Floor is t in UTC, truncated to the second.
func Floor(t time.Time) time.Time { return t.UTC().Truncate(time.Second) }

// Ceil is t in UTC, rounded up to the second.
func Ceil(t time.Time) time.Time {
	f := Floor(t)
	if f.Before(t) {
		return f.Add(time.Second)
	}
	return f
}

// Meter returns the records of in's release from in.From (or the run's
// start) to the end of its run, numbered from in.Segment; the last is
// Final. It returns no record when nothing is left to bill.
func Meter(in Input) ([]contracts.UsageRecord, error) {
	start, end, ok, err := Span(in.Entry)
	if err != nil || !ok {
		return nil, err
	}
	if !in.From.IsZero() {
		start = Floor(in.From)
	}
	if !start.Before(end) {
		return nil, nil
	}
	cuts := append(in.Book.Changes(start, end), midnights(start, end)...)
	slices.SortFunc(cuts, time.Time.Compare)
	cuts = slices.CompactFunc(cuts, time.Time.Equal)
	bounds := append(append([]time.Time{start}, cuts...), end)
	recs := make([]contracts.UsageRecord, 0, len(bounds)-1)
	for i := range len(bounds) - 1 {
		recs = append(recs, in.segment(in.Segment+i, bounds[i], bounds[i+1]))
	}
	recs[len(recs)-1].Final = true
	return recs, nil
}

// midnights are the UTC midnights strictly inside (from, to).
func midnights(from, to time.Time) []time.Time {
	var out []time.Time
	d := time.Date(from.Year(), from.Month(), from.Day(), 0, 0, 0, 0, time.UTC).AddDate(0, 0, 1)
	for ; d.Before(to); d = d.AddDate(0, 0, 1) {
		out = append(out, d)
	}
	return out
}

var (
	hour     = big.NewRat(3600, 1)
	perCore  = big.NewRat(1, 1000) // milli-CPU to cores
	perGiB   = big.NewRat(1, 1024) // MiB to GiB
	oneShare = big.NewRat(1, 1)
	percent  = big.NewRat(1, 100)
	sevenths = big.NewRat(1, contracts.MIGComputeSlices)
)

// segment prices [from, to) of the allocation.
func (in Input) segment(n int, from, to time.Time) contracts.UsageRecord {
	e, a := in.Entry, in.Entry.Allocation
	secs := int64(to.Sub(from) / time.Second)
	rec := contracts.UsageRecord{
		SchemaVersion: contracts.SchemaVersion,
		ID:            contracts.UsageSegmentID(a.ID, n),
		AllocationID:  a.ID,
		Tenant:        a.Tenant,
		JobID:         a.JobID,
		Attempt:       a.Attempt,
		NodeID:        a.NodeID,
		Pool:          a.Pool,
		GPUModel:      model(a.Devices),
		GPUs:          len(a.Devices),
		Start:         from,
		End:           to,
		GPUMillis:     int64(len(a.Devices)) * secs * 1000,
		GPUSeconds:    float64(int64(len(a.Devices)) * secs),
		Time:          e.Time,
		UsageSegment: contracts.UsageSegment{
			Segment:    n,
			Reason:     e.Reason,
			Devices:    a.Devices,
			Seconds:    secs,
			PriceClass: in.Node.Class,
		},
	}
	if rec.Pool == "" {
		rec.Pool = in.Node.Pool
	}
	if rec.PriceClass == "" {
		rec.PriceClass = contracts.PriceOnDemand
	}
	total := new(big.Rat)
	shares := make([]*big.Rat, len(a.Devices))
	for i, d := range a.Devices {
		shares[i] = in.share(d)
		total.Add(total, shares[i])
	}
	rec.GPUShare = total.RatString()
	v, ok := in.Book.At(from)
	if !ok {
		return rec // no price in effect yet: metered, not priced
	}
	rec.PriceVersion, rec.Currency = v.ID, v.Currency
	seconds := new(big.Rat).SetInt64(secs)
	gpu, onDemand := new(big.Rat), new(big.Rat)
	for i, d := range a.Devices {
		price, ok := v.GPUPrice(d.Model, rec.PriceClass)
		odPrice, _ := v.GPUPrice(d.Model, contracts.PriceOnDemand)
		if !ok {
			rec.Unpriced = true
			continue
		}
		if i == 0 {
			rec.GPURateMicros, rec.OnDemandRateMicros = int64(price), int64(odPrice)
		}
		gpu.Add(gpu, hourly(price, shares[i], seconds))
		onDemand.Add(onDemand, hourly(odPrice, shares[i], seconds))
	}
	rec.GPUCostMicros = round(gpu)
	if v.CPUCoreHour > 0 && in.CPUMilli > 0 {
		rec.CPUMilli = in.CPUMilli
		rec.CPUCostMicros = round(hourly(v.CPUCoreHour, new(big.Rat).Mul(big.NewRat(in.CPUMilli, 1), perCore), seconds))
	}
	if v.MemoryGiBHour > 0 && in.MemoryMiB > 0 {
		rec.MemoryMiB = in.MemoryMiB
		rec.MemoryCostMicros = round(hourly(v.MemoryGiBHour, new(big.Rat).Mul(big.NewRat(in.MemoryMiB, 1), perGiB), seconds))
	}
	rec.CostMicros = rec.GPUCostMicros + rec.CPUCostMicros + rec.MemoryCostMicros
	rec.OnDemandCostMicros = round(onDemand) + rec.CPUCostMicros + rec.MemoryCostMicros
	return rec
}

// hourly is price per hour × quantity × seconds, exactly.
func hourly(price contracts.Money, quantity, seconds *big.Rat) *big.Rat {
	r := new(big.Rat).SetInt64(int64(price))
	r.Mul(r, quantity)
	r.Mul(r, seconds)
	return r.Quo(r, hour)
}

// round is r rounded half to even to an integer (micro-units).
func round(r *big.Rat) int64 {
	q, m := new(big.Int).QuoRem(r.Num(), r.Denom(), new(big.Int))
	// r ≥ 0 here (prices and times are never negative): compare 2m to d.
	switch new(big.Int).Lsh(m, 1).Cmp(r.Denom()) {
	case 1:
		q.Add(q, big.NewInt(1))
	case 0:
		if q.Bit(0) == 1 {
			q.Add(q, big.NewInt(1))
		}
	}
	return q.Int64()
}

// share is the part of its card one device holds: 1 for a whole GPU; for
// a MIG instance its compute slices over the card's 7 (the profile's "g"),
// so 3g.40gb is 3/7 whatever its memory; for a fraction the larger of its
// memory share and its compute share, since either one is what keeps the
// rest of the card from others. A MIG profile billing cannot read is
// billed as the whole card.
func (in Input) share(d contracts.DeviceRef) *big.Rat {
	switch {
	case d.MIG != nil:
		g := 0
		if p, err := contracts.LookupMIGProfile(d.Model, d.MIG.Profile); err == nil {
			g = p.ComputeSlices
		} else if s, _, ok := strings.Cut(d.MIG.Profile, "g."); ok {
			g, _ = strconv.Atoi(s)
		}
		if g < 1 || g > contracts.MIGComputeSlices {
			return oneShare
		}
		return new(big.Rat).Mul(big.NewRat(int64(g), 1), sevenths)
	case d.Share != nil:
		s := new(big.Rat).Mul(big.NewRat(int64(d.Share.ComputePercent), 1), percent)
		if card := in.Node.GPUMemoryMiB[d.UUID]; card > 0 && d.Share.MemoryMiB > 0 {
			if m := big.NewRat(d.Share.MemoryMiB, card); m.Cmp(s) > 0 {
				s = m
			}
		}
		switch {
		case s.Sign() <= 0:
			return big.NewRat(1, 100) // a share of nothing still holds a context on the card
		case s.Cmp(oneShare) > 0:
			return oneShare
		}
		return s
	}
	return oneShare
}

// model names the devices' GPU model; several models, which one allocation
// should never hold, are listed in order joined by "+".
func model(devs []contracts.DeviceRef) string {
	var models []string
	for _, d := range devs {
		if !slices.Contains(models, d.Model) {
			models = append(models, d.Model)
		}
	}
	slices.Sort(models)
	return strings.Join(models, "+")
}

// Void is the record, numbered segment, that cancels rec: rec's segment
// with every quantity and cost negated, so a sum over an allocation's
// records counts rec no more. Rates, price version and bounds stay rec's,
// so the void falls in the same day, month, invoice line and price as rec.
func Void(rec contracts.UsageRecord, segment int, now time.Time) contracts.UsageRecord {
	v := rec
	v.ID = contracts.UsageSegmentID(rec.AllocationID, segment)
	v.Segment, v.Final, v.Provisional, v.Voids = segment, false, false, rec.ID
	v.Time = now
	v.Seconds, v.GPUMillis, v.GPUSeconds = -rec.Seconds, -rec.GPUMillis, -rec.GPUSeconds
	v.GPUCostMicros, v.CPUCostMicros, v.MemoryCostMicros = -rec.GPUCostMicros, -rec.CPUCostMicros, -rec.MemoryCostMicros
	v.CostMicros, v.OnDemandCostMicros = -rec.CostMicros, -rec.OnDemandCostMicros
	return v
}
