// Package backfill keeps a large job that waits from being starved by the
// small ones behind it, without leaving the capacity it waits for idle.
//
// For a job that does not fit now, Reserve finds the earliest time it would
// fit if every running job ended at its expected End (a job of unknown End
// never ends, for planning), and the machines it would then use: a
// Reservation. A Book collects the cycle's reservations; a later, smaller job
// of expected run time d may use a reserved machine only if it ends before
// the reservation starts, so it fills the hole without delaying the job
// ahead. A reservation holds only what its job will take on each machine
// (the devices, MIG instances or shares, and host capacity: Holds), so a
// later job that runs past its start may still use the rest of the machine.
// A job of unknown run time respects every reservation.
//
//	blocked job ──Reserve──▶ Reservation{Start, Nodes, Holds} ──Book.Add
//	later job   ──Book.Holds(now, expected)──▶ placement.Request.Reserved
//
// The guarantee holds as long as jobs end by their End: a backfilled job is
// given an End of now+expected by the caller, which stops it when a
// reservation it overlaps is due and it is still running.
//
// The package is pure: no bus, no clock (now is passed in).
package backfill

import (
	"cmp"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// Running is what one running job (or one machine of a gang, or a plan in
// flight) holds on a node, and when it is expected to end.
type Running struct {
	NodeID string
	// Devices are the GPUs (whole), MIG instances (MIG set) and shares
	// (Share set) the job holds on NodeID.
	Devices             []contracts.DeviceRef
	CPUMilli, MemoryMiB int64
	// End is when the job is expected to end: start plus its expected run
	// time, or its time limit. Zero means unknown: it never ends, for
	// planning. An End already past counts as ending now.
	End time.Time
}

// Reservation is the capacity held for one waiting job from Start on.
type Reservation struct {
	// Key names the waiting job (its queue key); Reserve leaves it empty
	// for the caller to set.
	Key string
	// Start is the earliest time the job fits on Nodes if running jobs end
	// at their End.
	Start time.Time
	// Nodes are the machines it would use (one per machine of a gang).
	Nodes map[string]bool
	// Holds are what it would take on each of Nodes at Start: the
	// devices, and the host capacity the machine has to spare then.
	Holds map[string]placement.Hold
	// Message says so for the job's pending reason.
	Message string
}

// Reserve returns the earliest time at or after now that r fits if the
// running jobs end at their End, and the nodes it would use then; false when
// it never would (jobs of unknown End hold what it needs, or no node has it).
//
// A single-machine request is checked node by node with placement.FitNode
// on the node as it would be at each End of the jobs on it; a gang of N
// machines starts when N nodes (in one zone, for TopologyZone) fit one
// machine's share each. Nodes in r.Exclude are not used; r.Reserved (the
// holds of reservations made earlier) count as taken from now on, so two
// reservations never count on the same device. r.AllowPool is asked once
// per pool. Ties go to the first node in ID order.
//
// Work is bounded per node: one FitNode call at the latest useful time, then
// a binary search over the distinct End times of the node's own jobs (fit
// only improves as jobs end), and only times earlier than the best found so
// far are examined.
func Reserve(snap placement.Snapshot, running []Running, r placement.Request, now time.Time) (Reservation, bool) {
	return NewPlanner(snap, running, now).Reserve(r)
}

// Planner answers Reserve for several requests over one snapshot, one
// list of running jobs and one now: what Reserve derives from those alone
// (the jobs grouped by node and sorted by release, the nodes in ID order)
// is derived once, at the first Reserve, not once per request. A cycle
// reserves for up to its MaxReservations jobs over ~40,000 running jobs
// at issue 17's scale. The snapshot's node list and running must not
// change while the planner is used.
type Planner struct {
	snap    placement.Snapshot
	running []Running
	now     time.Time
	ready   bool
	flat    []job
	start   []int
	order   []int
}

// NewPlanner is a Planner over snap, running and now.
func NewPlanner(snap placement.Snapshot, running []Running, now time.Time) *Planner {
	return &Planner{snap: snap, running: running, now: now}
}

// Reserve is Reserve(snap, running, r, now) of the planner's.
func (p *Planner) Reserve(r placement.Request) (Reservation, bool) {
	snap, now := p.snap, p.now
	m := r.Machines()
	if m < 1 || len(snap.Nodes) < m {
		return Reservation{}, false
	}
	one := r
	one.Exclude, one.AllowPool, one.Reserved = nil, nil, nil // checked here, once per node and pool
	if m > 1 {
		if r.GPU.Count%m != 0 {
			return Reservation{}, false // malformed gang: contracts validation refuses it too
		}
		one.GPU.Count = r.GPU.Count / m
		one.GPU.Nodes = 1
		if one.GPU.Topology == contracts.TopologyZone {
			one.GPU.Topology = contracts.TopologyAny // the zone is this package's check
		}
	}
	if !p.ready {
		p.flat, p.start = byNode(snap.Nodes, p.running, now)
		p.order = nodeOrder(snap.Nodes)
		p.ready = true
	}
	flat, start, order := p.flat, p.start, p.order
	allowed := map[string]bool{}
	allow := func(pool string) bool {
		if r.AllowPool == nil {
			return true
		}
		ok, seen := allowed[pool]
		if !seen {
			ok = r.AllowPool(pool)
			allowed[pool] = ok
		}
		return ok
	}
	zoned := m > 1 && r.GPU.Topology == contracts.TopologyZone
	groups := map[string]*best{} // by zone when zoned, else one under ""
	var groupOrder []string
	var scratch placement.Node
	var times []time.Time
	for rank, i := range order {
		n := &snap.Nodes[i]
		if r.Exclude[n.ID] || n.Cordoned || (r.Pool != "" && n.Pool != r.Pool) || !allow(n.Pool) ||
			!enoughGPUs(n, one.GPU) {
			continue
		}
		key := ""
		if zoned {
			key = n.Zone
		}
		g := groups[key]
		if g == nil {
			g = &best{size: m}
			groups[key] = g
			groupOrder = append(groupOrder, key)
		}
		nj := flat[start[i]:start[i+1]]
		times = releaseTimes(times[:0], now, nj)
		if limit, full := g.limit(); full {
			// Only a strictly earlier time can displace what the group has:
			// ties go to the nodes already taken, which come first.
			times = times[:sort.Search(len(times), func(k int) bool { return !times[k].Before(limit) })]
		}
		if len(times) == 0 {
			continue
		}
		hold, held := r.Reserved[n.ID]
		var base *placement.Node // n with the earlier holds, made once
		fits := func(k int) bool {
			at := times[k]
			if !releasesBy(nj, at) {
				if !held {
					_, ok := placement.FitNode(n, one) // the node as the snapshot has it
					return ok
				}
				if base == nil {
					b := hold.Held(n)
					base = &b
				}
				_, ok := placement.FitNode(base, one)
				return ok
			}
			stateAt(&scratch, n, nj, at)
			if held {
				hold.Apply(&scratch)
			}
			_, ok := placement.FitNode(&scratch, one)
			return ok
		}
		last := len(times) - 1
		if !fits(last) {
			continue
		}
		k := sort.Search(last, fits) // smallest k in [0,last) that fits, else last
		g.add(cand{at: times[k], rank: rank, node: i})
	}
	// Choose the group (zone) that starts first; ties to the one whose
	// nodes come first.
	var chosen *best
	for _, key := range groupOrder {
		g := groups[key]
		if len(g.c) < m {
			continue
		}
		if chosen == nil || g.start().Before(chosen.start()) ||
			(g.start().Equal(chosen.start()) && g.firstRank() < chosen.firstRank()) {
			chosen = g
		}
	}
	if chosen == nil {
		return Reservation{}, false
	}
	slices.SortFunc(chosen.c, func(a, b cand) int { return cmp.Compare(a.rank, b.rank) })
	res := Reservation{Start: chosen.start(), Nodes: make(map[string]bool, m), Holds: make(map[string]placement.Hold, m)}
	ids := make([]string, 0, m)
	for _, c := range chosen.c {
		n := &snap.Nodes[c.node]
		res.Nodes[n.ID] = true
		ids = append(ids, n.ID)
		// What it takes there at Start: the node then, as Reserve saw it.
		stateAt(&scratch, n, flat[start[c.node]:start[c.node+1]], res.Start)
		if hold, held := r.Reserved[n.ID]; held {
			hold.Apply(&scratch)
		}
		devs := holdDevices(&scratch, n, one)
		res.Holds[n.ID] = placement.Hold{Devices: devs,
			SpareCPUMilli: scratch.CPUMilliFree - one.CPUMilli, SpareMemoryMiB: scratch.MemoryMiBFree - one.MemoryMiB}
	}
	res.Message = message(res.Start, now, ids)
	return res, true
}

// message reads "capacity reserved on h100-03 from 2026-01-02T15:04:05Z (in
// 25m), when running jobs are expected to end". The wait is rounded (Wait)
// so the message changes when its facts do, not with every cycle's clock.
func message(start, now time.Time, ids []string) string {
	const show = 4
	nodes := strings.Join(ids[:min(len(ids), show)], ", ")
	if len(ids) > show {
		nodes += fmt.Sprintf(" and %d more", len(ids)-show)
	}
	if !start.After(now) {
		return "capacity reserved on " + nodes + " from now (the jobs holding it are expected to have ended)"
	}
	return fmt.Sprintf("capacity reserved on %s from %s (in %s), when running jobs are expected to end",
		nodes, start.UTC().Format(time.RFC3339), Wait(start.Sub(now)))
}

// Wait rounds a wait for people: to 10 seconds under a minute, to the
// minute under an hour, to 10 minutes beyond; "under 10s" below 5
// seconds, never "0s".
func Wait(d time.Duration) string {
	switch {
	case d < 5*time.Second:
		return "under 10s"
	case d < time.Minute:
		return d.Round(10 * time.Second).String()
	case d < time.Hour:
		d = d.Round(time.Minute)
	default:
		d = d.Round(10 * time.Minute)
	}
	s := strings.TrimSuffix(d.String(), "0s")
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// holdDevices chooses the devices one machine of r takes on at (node n at
// the reservation's start): those busy now first, so that what is free now
// stays free for jobs that run past the start. It marks the devices free
// now as taken and gives them back one at a time, lowest index first,
// until FitNode finds room; at is modified. Shares are left to FitNode.
func holdDevices(at *placement.Node, n *placement.Node, r placement.Request) []contracts.DeviceRef {
	type free struct{ gpu, inst int } // inst -1: the whole card
	var now []free
	for i := range at.GPUs {
		g := &at.GPUs[i]
		k := slices.IndexFunc(n.GPUs, func(x placement.GPU) bool { return x.UUID == g.UUID && x.Index == g.Index })
		if k < 0 {
			continue
		}
		was := &n.GPUs[k]
		switch {
		case g.MIG:
			for j := range g.Instances {
				if !g.Instances[j].Held && j < len(was.Instances) && !was.Instances[j].Held {
					now = append(now, free{i, j})
				}
			}
		case !g.Held && !was.Held && was.ShareMemMiB == 0 && was.SharePercent == 0 && g.ShareMemMiB == 0 && g.SharePercent == 0:
			now = append(now, free{i, -1})
		}
	}
	if len(now) == 0 || r.GPU.Kind() == contracts.GPUKindShare {
		devs, _ := placement.FitNode(at, r)
		return devs
	}
	for i := range at.GPUs {
		if len(at.GPUs[i].Instances) > 0 {
			at.GPUs[i].Instances = slices.Clone(at.GPUs[i].Instances) // private: marked below
		}
	}
	mark := func(f free, held bool) {
		if f.inst < 0 {
			at.GPUs[f.gpu].Held = held
		} else {
			at.GPUs[f.gpu].Instances[f.inst].Held = held
		}
	}
	for _, f := range now {
		mark(f, true)
	}
	for k := 0; ; k++ {
		if devs, ok := placement.FitNode(at, r); ok {
			return devs
		}
		if k == len(now) {
			return nil
		}
		mark(now[k], false)
	}
}

// job is a running job on one node with the time it releases what it holds.
type job struct {
	at time.Time
	*Running
}

// byNode groups the jobs of known End by snapshot node: the jobs of node i
// are flat[start[i]:start[i+1]], by release time. Jobs of unknown End are
// left out: for planning they hold their devices forever, as the snapshot
// already shows them held. Jobs on nodes outside the snapshot are ignored.
// One flat slice rather than a map of slices: this runs over every job of
// the cluster once per reservation.
func byNode(nodes []placement.Node, running []Running, now time.Time) (flat []job, start []int) {
	index := make(map[string]int, len(nodes))
	for i := range nodes {
		index[nodes[i].ID] = i
	}
	start = make([]int, len(nodes)+1)
	where := make([]int32, len(running))
	for i := range running {
		where[i] = -1
		if running[i].End.IsZero() {
			continue
		}
		if n, ok := index[running[i].NodeID]; ok {
			where[i] = int32(n)
			start[n+1]++
		}
	}
	for i := range nodes {
		start[i+1] += start[i]
	}
	flat = make([]job, start[len(nodes)])
	next := slices.Clone(start[:len(nodes)])
	for i := range running {
		n := where[i]
		if n < 0 {
			continue
		}
		at := running[i].End
		if at.Before(now) {
			at = now
		}
		flat[next[n]] = job{at: at, Running: &running[i]}
		next[n]++
	}
	for i := range nodes {
		if js := flat[start[i]:start[i+1]]; len(js) > 1 {
			slices.SortStableFunc(js, func(a, b job) int { return a.at.Compare(b.at) })
		}
	}
	return flat, start
}

// releaseTimes appends to dst the times a node's state can change: now, then
// each distinct release time of its jobs.
func releaseTimes(dst []time.Time, now time.Time, js []job) []time.Time {
	dst = append(dst, now)
	for _, j := range js {
		if j.at.After(dst[len(dst)-1]) {
			dst = append(dst, j.at)
		}
	}
	return dst
}

// releasesBy reports whether any job of js (sorted) releases at or before at.
func releasesBy(js []job, at time.Time) bool { return len(js) > 0 && !js[0].at.After(at) }

// stateAt writes into dst node n as it is at time at: every job of js that
// ends by then released. dst's GPU slice is reused between calls; n is never
// modified (MIG instance lists are copied before a slot is freed).
func stateAt(dst *placement.Node, n *placement.Node, js []job, at time.Time) {
	gpus := append(dst.GPUs[:0], n.GPUs...)
	*dst = *n
	dst.GPUs = gpus
	var copied []bool // made on the first MIG release: which GPUs' Instances are private
	for _, j := range js {
		if j.at.After(at) {
			break
		}
		dst.CPUMilliFree += j.CPUMilli
		dst.MemoryMiBFree += j.MemoryMiB
		for _, d := range j.Devices {
			gi := findGPU(dst.GPUs, d)
			if gi < 0 {
				continue // the device left the snapshot (unhealthy): nothing to free
			}
			g := &dst.GPUs[gi]
			switch {
			case d.MIG != nil:
				si := findSlot(g.Instances, d.MIG)
				if si < 0 {
					continue
				}
				if len(copied) == 0 {
					copied = make([]bool, len(dst.GPUs))
				}
				if !copied[gi] {
					g.Instances = slices.Clone(g.Instances)
					copied[gi] = true
				}
				g.Instances[si].Held = false
			case d.Share != nil:
				g.ShareMemMiB = max(0, g.ShareMemMiB-d.Share.MemoryMiB)
				g.SharePercent = max(0, g.SharePercent-d.Share.ComputePercent)
			default:
				g.Held = false
			}
		}
	}
}

func findGPU(gpus []placement.GPU, d contracts.DeviceRef) int {
	for i := range gpus {
		if d.UUID != "" && gpus[i].UUID != "" {
			if gpus[i].UUID == d.UUID {
				return i
			}
			continue
		}
		if gpus[i].Index == d.Index {
			return i
		}
	}
	return -1
}

func findSlot(slots []placement.MIGSlot, mig *contracts.MIGInstance) int {
	for i, s := range slots {
		if mig.UUID != "" && s.Instance.UUID != "" {
			if s.Instance.UUID == mig.UUID {
				return i
			}
			continue
		}
		if s.Instance.GIID == mig.GIID && s.Instance.CIID == mig.CIID {
			return i
		}
	}
	return -1
}

// enoughGPUs is a cheap filter before any FitNode: a node with fewer cards
// (or, for MIG, instances of any kind) than one machine needs never fits.
func enoughGPUs(n *placement.Node, g contracts.GPURequest) bool {
	switch g.Kind() {
	case contracts.GPUKindMIG:
		for _, gpu := range n.GPUs {
			if gpu.MIG && len(gpu.Instances) > 0 {
				return true
			}
		}
		return false
	case contracts.GPUKindShare:
		return len(n.GPUs) > 0
	}
	return len(n.GPUs) >= g.Count
}

// nodeOrder returns the indexes of nodes in ID order (the snapshot's own
// order when it already is).
func nodeOrder(nodes []placement.Node) []int {
	order := make([]int, len(nodes))
	for i := range order {
		order[i] = i
	}
	if !slices.IsSortedFunc(nodes, func(a, b placement.Node) int { return strings.Compare(a.ID, b.ID) }) {
		slices.SortStableFunc(order, func(a, b int) int { return strings.Compare(nodes[a].ID, nodes[b].ID) })
	}
	return order
}

// cand is a node and the earliest time one machine of the request fits on it.
type cand struct {
	at   time.Time
	rank int // position in node order
	node int // index in the snapshot
}

// best keeps the size earliest candidates seen (ties to the lower rank):
// a max-heap on (at, rank), so the worst is at the root.
type best struct {
	size int
	c    []cand
}

func worse(a, b cand) bool {
	if c := a.at.Compare(b.at); c != 0 {
		return c > 0
	}
	return a.rank > b.rank
}

// limit is the time a new candidate must beat once the heap is full.
func (b *best) limit() (time.Time, bool) {
	if len(b.c) < b.size {
		return time.Time{}, false
	}
	return b.c[0].at, true
}

func (b *best) add(c cand) {
	if len(b.c) < b.size {
		b.c = append(b.c, c)
		for i := len(b.c) - 1; i > 0; {
			p := (i - 1) / 2
			if !worse(b.c[i], b.c[p]) {
				break
			}
			b.c[i], b.c[p] = b.c[p], b.c[i]
			i = p
		}
		return
	}
	if !worse(b.c[0], c) {
		return
	}
	b.c[0] = c
	for i := 0; ; {
		l, m := 2*i+1, i
		if l < len(b.c) && worse(b.c[l], b.c[m]) {
			m = l
		}
		if r := l + 1; r < len(b.c) && worse(b.c[r], b.c[m]) {
			m = r
		}
		if m == i {
			return
		}
		b.c[i], b.c[m] = b.c[m], b.c[i]
		i = m
	}
}

// start is when every kept candidate fits: the latest of them.
func (b *best) start() time.Time {
	var s time.Time
	for _, c := range b.c {
		if c.at.After(s) {
			s = c.at
		}
	}
	return s
}

func (b *best) firstRank() int {
	r := b.c[0].rank
	for _, c := range b.c {
		r = min(r, c.rank)
	}
	return r
}

// Book holds the reservations of one scheduling cycle.
type Book struct {
	res []Reservation
}

// Add keeps res. Reservations are expected not to share nodes (pass the
// earlier ones' nodes as the next request's Exclude); if they do, each
// still protects its own Start.
func (b *Book) Add(res Reservation) { b.res = append(b.res, res) }

// Reservations returns the reservations added, in order.
func (b *Book) Reservations() []Reservation { return slices.Clone(b.res) }

// All returns the reservations added, in order, without a copy: the
// caller must not modify the slice or keep it past the next Add or Drop
// (a cycle reads it once per job).
func (b *Book) All() []Reservation { return b.res }

// Drop forgets the reservation of key (its job is being decided again)
// and reports whether there was one.
func (b *Book) Drop(key string) bool {
	n := len(b.res)
	b.res = slices.DeleteFunc(b.res, func(r Reservation) bool { return r.Key == key })
	return len(b.res) != n
}

// Len is how many reservations the book holds.
func (b *Book) Len() int { return len(b.res) }

// Delays reports whether a job expected to run for expected from now would
// still run when res starts (expected 0, unknown: it would).
func Delays(res Reservation, now time.Time, expected time.Duration) bool {
	return expected <= 0 || res.Start.Before(now.Add(expected))
}

// Holds returns what a job expected to run for expected from now must
// leave alone so as not to delay any reservation for which applies says
// yes (nil: every one): the holds, merged by node, of every one that
// starts before the job would end. nil when none.
func (b *Book) Holds(now time.Time, expected time.Duration, applies func(Reservation) bool) map[string]placement.Hold {
	var out map[string]placement.Hold
	for _, res := range b.res {
		if !Delays(res, now, expected) || (applies != nil && !applies(res)) {
			continue
		}
		if out == nil {
			out = make(map[string]placement.Hold)
		}
		for id, h := range res.Holds {
			if cur, ok := out[id]; ok {
				h = cur.Merge(h)
			}
			out[id] = h
		}
	}
	return out
}

// Exclude returns the nodes a job expected to run for expected from now must
// avoid so as not to delay any reservation: those of every reservation that
// starts before the job would end. expected 0 (unknown) avoids every
// reserved node. nil when nothing is reserved.
func (b *Book) Exclude(now time.Time, expected time.Duration) map[string]bool {
	var out map[string]bool
	end := now.Add(expected)
	for _, res := range b.res {
		if expected > 0 && !res.Start.Before(end) {
			continue // the job ends by the reservation's start
		}
		if out == nil {
			out = make(map[string]bool)
		}
		for id, ok := range res.Nodes {
			if ok {
				out[id] = true
			}
		}
	}
	return out
}
