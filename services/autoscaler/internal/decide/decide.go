// Package decide is the autoscaler's pure core: from one pool's pending
// demand, its machine type and its last decision, it says whether the pool
// should grow and to how many nodes, with a reason a person can read. It
// never touches the network or a clock; the caller passes the time in.
//
// Sizing bin-packs the waiting shapes, first-fit decreasing, onto
// hypothetical empty machines of the pool's machine type. A shape larger than
// one machine, or wanting another GPU model, cannot be helped by more
// machines of this type: it is left out and named in the reason.
package decide

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// Machine is the shape of one machine of a pool.
type Machine struct {
	Type  string
	GPUs  int
	Model string
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
		if s.GPUs <= 0 || s.Count <= 0 {
			continue
		}
		if in.Machine.GPUs > 0 {
			switch {
			case s.GPUs > in.Machine.GPUs:
				unhelped = append(unhelped, s)
				notHelped = append(notHelped, fmt.Sprintf("%s of %d GPUs (more than one %s machine has)",
					plural(s.Count, "job"), s.GPUs, in.Machine.Type))
				continue
			case s.Model != "" && s.Model != contracts.GPUModelAny && in.Machine.Model != "" && s.Model != in.Machine.Model:
				unhelped = append(unhelped, s)
				notHelped = append(notHelped, fmt.Sprintf("%s wanting %s (the pool's machines have %s)",
					plural(s.Count, "job"), s.Model, in.Machine.Model))
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
	need, complete := pack(helped, in.Machine.GPUs, booting, max(headroom, 0)+packSlack)
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
// capacity GPUs, then onto new empty ones, and returns how many new
// machines it used. It stops at limit new machines, returning limit and
// false when the shapes need more, so that a huge Count costs at most
// (booting+limit)×capacity steps.
func pack(shapes []contracts.Shape, capacity, booting, limit int) (machines int, complete bool) {
	sorted := slices.Clone(shapes)
	slices.SortStableFunc(sorted, func(a, b contracts.Shape) int { return cmp.Compare(b.GPUs, a.GPUs) })
	free := make([]int, booting) // free GPUs per machine: the booting ones first
	for i := range free {
		free[i] = capacity
	}
	for _, s := range sorted {
		for range s.Count {
			i := slices.IndexFunc(free, func(f int) bool { return f >= s.GPUs })
			if i < 0 {
				if len(free)-booting == limit {
					return limit, false
				}
				free = append(free, capacity)
				i = len(free) - 1
			}
			free[i] -= s.GPUs
		}
	}
	return len(free) - booting, true
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
		p := fmt.Sprintf("%d×%d GPU", s.Count, s.GPUs)
		if s.GPUs != 1 {
			p += "s"
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
