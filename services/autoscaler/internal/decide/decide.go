// Package decide is the autoscaler's pure core: from one pool's pending
// demand, its machine type and its last decision, it says whether the pool
// should grow and to how many nodes, with a reason a person can read. It
// never touches the network or a clock; the caller passes the time in.
//
// Sizing bin-packs the waiting shapes, first-fit decreasing, onto
// hypothetical empty machines of the pool's machine type: whole-GPU shapes
// onto its GPUs outside MIG mode, MIG shapes onto its MIG instances of their
// profile, shares onto GPUs outside MIG mode that no whole-GPU shape took
// (several per GPU, within 100% compute and the GPU's memory). A shape no
// empty machine of this type could hold (more GPUs than it has, another GPU
// model, a MIG profile it lacks, a share bigger than its GPU) cannot be
// helped by more machines: it is left out and named in the reason.
package decide

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Machine is the shape of one machine of a pool.
type Machine struct {
	Type string
	// GPUs is all the GPUs of one machine, MIG mode or not.
	GPUs  int
	Model string
	// MemoryMiB is one GPU's framebuffer, what shares pack against; 0 when
	// unknown, and then only their compute is counted.
	MemoryMiB int64
	// MIGGPUs is how many of the GPUs are in MIG mode: they hold MIG
	// instances only, never a whole-GPU job or a share.
	MIGGPUs int
	// MIG is, per MIG profile, how many instances of it one machine has
	// (over all its MIG GPUs). Instances exist before any job, so each is
	// a slot of its own.
	MIG map[string]int
}

// plainGPUs is how many GPUs of m take whole-GPU jobs and shares.
func (m Machine) plainGPUs() int { return max(0, m.GPUs-max(0, m.MIGGPUs)) }

// holds says why an empty machine of type m cannot hold one job of s, ""
// when it can.
func (m Machine) holds(s contracts.Shape) string {
	if s.Model != "" && s.Model != contracts.GPUModelAny && m.Model != "" && s.Model != m.Model {
		return fmt.Sprintf("wanting %s (the pool's machines have %s)", s.Model, m.Model)
	}
	switch s.Kind() {
	case contracts.GPUKindMIG:
		if m.MIG[s.MIGProfile] <= 0 {
			return fmt.Sprintf("wanting MIG %s (%s machines have none)", s.MIGProfile, m.Type)
		}
	case contracts.GPUKindShare:
		switch {
		case m.plainGPUs() == 0:
			return fmt.Sprintf("wanting a GPU share (%s machines have every GPU in MIG mode)", m.Type)
		case m.MemoryMiB > 0 && s.Share.MemoryMiB > m.MemoryMiB:
			return fmt.Sprintf("wanting a share of %d MiB (more than a GPU of %s machines has)", s.Share.MemoryMiB, m.Type)
		case s.Share.ComputePercent > 100:
			return fmt.Sprintf("wanting a share of %d%% compute (more than one GPU has)", s.Share.ComputePercent)
		}
	default:
		if s.GPUs > m.plainGPUs() {
			if m.MIGGPUs > 0 {
				return fmt.Sprintf("of %d GPUs (more than the %s outside MIG mode one %s machine has)",
					s.GPUs, plural(m.plainGPUs(), "GPU"), m.Type)
			}
			return fmt.Sprintf("of %d GPUs (more than one %s machine has)", s.GPUs, m.Type)
		}
	}
	return ""
}

// Previous is the last decision published for a pool.
type Previous struct {
	ID      string
	Current int
	Desired int
	Time    time.Time
}

// Input is everything one decision depends on.
type Input struct {
	Demand contracts.PoolDemand
	// DemandSeq is the stream sequence of Demand; it makes the decision ID
	// deterministic.
	DemandSeq uint64
	// Machine is the pool's machine type; zero when no inventory is known.
	Machine Machine
	// LiveNodes is the inventory's count of live nodes, used only when the
	// demand does not carry its own node count.
	LiveNodes int
	// Booting is how many machines the autoscaler already asked for that
	// the demand does not count: provisioning at the provider, booted but
	// not registered, or being created. They will be empty machines of the
	// pool's type, so waiting shapes are packed onto them before any new
	// machine is added, and they count in the current size. Leaving them
	// out asks again for the same shapes when a cooldown ends before they
	// boot.
	Booting int
	// Max is the most nodes the pool may have.
	Max int
	// Cooldown is the least time between two decisions for the pool.
	Cooldown time.Duration
	// Last is the previous decision for the pool, nil when none.
	Last *Previous
	Now  time.Time
}

// Outcome is a decision to publish, or none, and why.
type Outcome struct {
	// Decision is nil when the pool should stay as it is.
	Decision *contracts.ScaleDecision
	Why      string
}

// Decide computes the decision for one pool.
//
// The current size is the demand's own node count (the fleet its waiting
// shapes were computed against) plus the booting machines. Sizing against a
// fresher inventory while the demand is stale would ask again for machines
// that already arrived; the caller counts a machine registered after the
// demand was computed as booting for the same reason.
func Decide(in Input) Outcome {
	pool := in.Demand.Pool
	var helped, unhelped []contracts.Shape
	var notHelped []string
	for _, s := range in.Demand.Waiting {
		if s.Count <= 0 || s.Kind() == contracts.GPUKindWhole && s.GPUs <= 0 {
			continue
		}
		if in.Machine.GPUs > 0 {
			if why := in.Machine.holds(s); why != "" {
				unhelped = append(unhelped, s)
				notHelped = append(notHelped, plural(s.Count, "job")+" "+why)
				continue
			}
		}
		helped = append(helped, s)
	}
	switch {
	case len(helped) == 0 && len(unhelped) == 0:
		return Outcome{Why: "nothing waits for pool " + pool}
	case in.Machine.GPUs <= 0:
		return Outcome{Why: fmt.Sprintf("pool %s: machine type unknown (no inventory with GPUs); cannot size a scale-up", pool)}
	case len(helped) == 0:
		return Outcome{Why: "more machines would not help: " + strings.Join(notHelped, "; ")}
	}

	registered := in.Demand.Nodes
	if registered <= 0 {
		registered = in.LiveNodes
	}
	booting := max(in.Booting, 0)
	current := registered + booting
	headroom := in.Max - current
	// Pack past the headroom so the reason can say what the demand really
	// needs, but bounded: a huge Count costs at most that many machines.
	need, complete := pack(helped, in.Machine, booting, max(headroom, 0)+packSlack)
	if need == 0 {
		return Outcome{Why: fmt.Sprintf("pool %s: %s waiting (%s) fit on the %s already booting",
			pool, plural(count(helped), "job"), shapes(helped), plural(booting, in.Machine.Type+" machine"))}
	}
	if headroom <= 0 {
		nodes := plural(current, "node")
		if booting > 0 {
			nodes += fmt.Sprintf(" (%d booting)", booting)
		}
		return Outcome{Why: fmt.Sprintf("pool %s has %s, at or above its maximum of %d", pool, nodes, in.Max)}
	}
	desired := current + min(need, headroom)

	if l := in.Last; l != nil {
		if l.Current == current && l.Desired == desired {
			return Outcome{Why: fmt.Sprintf("already decided: %d to %d nodes (%s)", current, desired, l.ID)}
		}
		if next := l.Time.Add(in.Cooldown); in.Now.Before(next) {
			return Outcome{Why: fmt.Sprintf("in cooldown until %s after decision %s", next.UTC().Format(time.RFC3339), l.ID)}
		}
	}

	var reason strings.Builder
	fmt.Fprintf(&reason, "%s waiting (%s) ", plural(count(helped), "job"), shapes(helped))
	if complete {
		fmt.Fprintf(&reason, "need %s", plural(need, "more "+in.Machine.Type+" machine"))
	} else {
		fmt.Fprintf(&reason, "need more than %s", plural(need, "more "+in.Machine.Type+" machine"))
	}
	fmt.Fprintf(&reason, " of %s", plural(in.Machine.GPUs, "GPU"))
	if booting > 0 {
		fmt.Fprintf(&reason, " beyond the %s booting", plural(booting, "machine"))
	}
	if need > headroom {
		fmt.Fprintf(&reason, "; capped at the pool maximum of %d nodes", in.Max)
	}
	if len(notHelped) > 0 {
		fmt.Fprintf(&reason, "; not helped by scaling: %s", strings.Join(notHelped, "; "))
	}
	return Outcome{Decision: &contracts.ScaleDecision{
		SchemaVersion: contracts.SchemaVersion,
		ID:            ID(pool, in.DemandSeq, contracts.ScaleUp, desired),
		Pool:          pool,
		Direction:     contracts.ScaleUp,
		CurrentNodes:  current,
		DesiredNodes:  desired,
		Reason:        reason.String(),
		Time:          in.Now,
	}, Why: reason.String()}
}

// packSlack is how many machines beyond a pool's headroom sizing counts
// before it stops and says "more than".
const packSlack = 1000

// ID is the deterministic ID (and Nats-Msg-Id) of a decision: the same
// demand message sized to the same target always yields the same ID.
func ID(pool string, demandSeq uint64, dir contracts.ScaleDirection, desired int) string {
	return "scale/" + pool + "/" + strconv.FormatUint(demandSeq, 10) + "/" + string(dir) + "-" + strconv.Itoa(desired)
}

// pack bin-packs the shapes first-fit decreasing onto booting machines of
// type m, then onto new empty ones, and returns how many new machines it
// used. Every shape must fit an empty machine (m.holds). It stops at limit
// new machines, returning limit and false when the shapes need more.
//
// Whole-GPU shapes go first (largest first), so shares fill what they
// leave; then shares (largest compute first), then MIG shapes, which
// compete with nothing else. Equal jobs are placed in bulk, as many as fit
// on a machine at once, which is what one-by-one first fit gives for
// identical items; so a huge Count costs a step per machine, not per job.
func pack(shapes []contracts.Shape, m Machine, booting, limit int) (machines int, complete bool) {
	sorted := slices.Clone(shapes)
	slices.SortStableFunc(sorted, func(a, b contracts.Shape) int {
		return cmp.Or(cmp.Compare(packOrder(a), packOrder(b)), cmp.Compare(b.GPUs, a.GPUs),
			cmp.Compare(shareOf(b).ComputePercent, shareOf(a).ComputePercent),
			cmp.Compare(shareOf(b).MemoryMiB, shareOf(a).MemoryMiB))
	})
	hosts := make([]*host, booting) // the booting ones first
	for i := range hosts {
		hosts[i] = newHost(m)
	}
	for _, s := range sorted {
		left := s.Count
		for _, h := range hosts {
			if left == 0 {
				break
			}
			left -= h.take(s, left)
		}
		for left > 0 {
			if len(hosts)-booting == limit {
				return limit, false
			}
			h := newHost(m)
			hosts = append(hosts, h)
			left -= h.take(s, left)
		}
	}
	return len(hosts) - booting, true
}

func packOrder(s contracts.Shape) int {
	switch s.Kind() {
	case contracts.GPUKindShare:
		return 1
	case contracts.GPUKindMIG:
		return 2
	}
	return 0
}

func shareOf(s contracts.Shape) contracts.GPUShare {
	if s.Share == nil {
		return contracts.GPUShare{}
	}
	return *s.Share
}

// host is one hypothetical machine while packing. Each GPU outside MIG mode
// is decided on its own: taken whole, or holding shares, never both.
type host struct {
	memMiB    int64
	whole     int      // GPUs outside MIG mode with nothing on them
	shared    []gpuUse // GPUs outside MIG mode holding shares
	instances map[string]int
}

type gpuUse struct {
	percent int
	memMiB  int64
}

func newHost(m Machine) *host {
	return &host{memMiB: m.MemoryMiB, whole: m.plainGPUs(), instances: maps.Clone(m.MIG)}
}

// take places up to n jobs of s on h and returns how many it placed.
func (h *host) take(s contracts.Shape, n int) int {
	switch s.Kind() {
	case contracts.GPUKindMIG:
		k := min(n, h.instances[s.MIGProfile])
		h.instances[s.MIGProfile] -= k
		return k
	case contracts.GPUKindShare:
		// A share of no compute or memory would fit without end; count
		// it as the least a share can be.
		pct, mem := max(1, s.Share.ComputePercent), max(0, s.Share.MemoryMiB)
		fits := func(u gpuUse) int {
			k := (100 - u.percent) / pct
			if h.memMiB > 0 && mem > 0 {
				k = min(k, int((h.memMiB-u.memMiB)/mem))
			}
			return max(0, k)
		}
		placed := 0
		for i := range h.shared {
			k := min(n-placed, fits(h.shared[i]))
			h.shared[i].percent += k * pct
			h.shared[i].memMiB += int64(k) * mem
			placed += k
		}
		for placed < n && h.whole > 0 {
			k := min(n-placed, fits(gpuUse{}))
			if k == 0 {
				break
			}
			h.whole--
			h.shared = append(h.shared, gpuUse{percent: k * pct, memMiB: int64(k) * mem})
			placed += k
		}
		return placed
	}
	g := max(1, s.GPUs)
	k := min(n, h.whole/g)
	h.whole -= k * g
	return k
}

func count(ss []contracts.Shape) int {
	n := 0
	for _, s := range ss {
		n += s.Count
	}
	return n
}

func shapes(ss []contracts.Shape) string {
	parts := make([]string, 0, len(ss))
	for _, s := range ss {
		var p string
		switch s.Kind() {
		case contracts.GPUKindMIG:
			p = fmt.Sprintf("%d×MIG %s", s.Count, s.MIGProfile)
		case contracts.GPUKindShare:
			p = fmt.Sprintf("%d×share %d%%/%d MiB", s.Count, s.Share.ComputePercent, s.Share.MemoryMiB)
		default:
			p = fmt.Sprintf("%d×%d GPU", s.Count, s.GPUs)
			if s.GPUs != 1 {
				p += "s"
			}
		}
		if s.Model != "" && s.Model != contracts.GPUModelAny {
			p += " " + s.Model
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, ", ")
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}
