package resourcemanager

import (
	"context"
	"strconv"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
)

// onPlanMsg handles one plan: each item is committed or refused on its own
// (a plan may be accepted in part), and the plan is acknowledged only when
// every item has its answer in a stream. A transient failure returns an
// error and the whole plan comes again; items already answered are then
// no-ops (committed: Duplicate; refused: the same RefusalID, deduplicated).
func (s *server) onPlanMsg(ctx context.Context, m *bus.Msg) error {
	var p contracts.Plan
	if err := m.Decode(&p); err != nil {
		return bus.Permanent(err)
	}
	planID := p.ID
	if planID == "" {
		planID = "seq-" + strconv.FormatUint(m.StreamSeq, 10)
	}
	log := s.log.With("plan_id", planID, "scheduler", p.Scheduler, "stream_seq", m.StreamSeq)
	planned := m.Timestamp
	s.observe(planned)
	if planned.IsZero() {
		// No stamp (no metadata): its age unknown, so taken as too old.
		planned = time.Unix(0, 0)
	}
	for i := range p.Items {
		if p.Items[i].PlanID == "" {
			p.Items[i].PlanID = p.ID
		}
		if p.Items[i].Scheduler == "" {
			p.Items[i].Scheduler = p.Scheduler
		}
	}
	if p.Epoch > 0 {
		// A plan may arrive before its leader's lease does: its epoch
		// alone fences out the deposed leader's later plans.
		s.mu.Lock()
		s.observeEpoch(p.Scheduler, p.Epoch)
		s.mu.Unlock()
	}
	// Plans that name a job in common are decided one after the other
	// (plans_gate.go); others go on at once.
	leave, err := s.planGate.enter(ctx, planJobs(p.Items))
	if err != nil {
		return err
	}
	defer leave()
	var committed, duplicate, refused, settled atomic.Int64
	// settle answers one item: committed, or refused in a stream.
	settle := func(ctx context.Context, i int) error {
		item := p.Items[i]
		if s.wasRefused(planID, i, item) {
			// Answered before this delivery: the scheduler already put the
			// job back; committing now would be a second, contrary answer.
			refused.Add(1)
			settled.Add(1)
			return nil
		}
		v, err := s.commitFenced(ctx, item, p.Epoch, planned)
		if err != nil {
			log.Warn("plan item not settled; plan will be redelivered", "alloc_id", item.ID, "err", err)
			return err
		}
		switch {
		case v.Refused():
			refused.Add(1)
			if err := s.refuse(ctx, planID, i, item, v, planned); err != nil {
				return err
			}
		case v.Duplicate:
			duplicate.Add(1)
		default:
			committed.Add(1)
		}
		if settled.Add(1)%64 == 0 {
			_ = m.InProgress() // a long plan must not outlive AckWait
		}
		return nil
	}
	// Items on different nodes touch different ledger subjects, so they
	// commit concurrently: a plan costs about one compare-and-set round
	// trip per item on its busiest node, not one per item. Items of one
	// node keep their order (each CAS builds on the previous one).
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(s.cfg.CommitParallelism)
	for _, group := range commitGroups(p.Items) {
		g.Go(func() error {
			for _, i := range group {
				if err := settle(gctx, i); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	log.Info("plan settled", "items", len(p.Items), "committed", committed.Load(), "duplicate", duplicate.Load(), "refused", refused.Load())
	return nil
}

// later is the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// planExpired reports whether a plan stored at planned is PlanMaxAge old
// by the log's clock, the later of the ledger's and the refusals' (the
// clocks by which ended allocations and refusals are forgotten). Under
// s.mu.
//
// Why an item of such a plan is refused rather than judged by the
// ledger: its allocation may have ended and been forgotten. A retired
// record is forgotten once the ledger's clock is ledger.Keep past its
// release (recset.Window), and the plan was stored before the release, so
// the plan is then at least Keep - ClockSkew = PlanMaxAge old, ClockSkew
// being the margin for NATS servers' clocks to disagree (every date here
// is a stream's stamp: stampOf). The same holds for a refusal, stored
// after its plan. PLANS drops plans at that age anyway: this is the rule
// that makes forgetting safe, not a path production takes. The time is
// the stream's, not the one the scheduler wrote in the plan: a
// scheduler's clock a day behind must not make every plan expired.
func (s *server) planExpired(planned time.Time) bool {
	if planned.IsZero() {
		return false // not a plan's item (commit)
	}
	clock := s.led.Clock()
	if c := s.refused.Clock(); c.After(clock) {
		clock = c
	}
	return !clock.IsZero() && clock.Sub(planned) >= s.cfg.PlanMaxAge
}

// commitGroups splits a plan's item indexes into groups that may commit
// concurrently: one per node, in plan order. A plan that names one
// allocation ID twice is one group, in order: "already allocated" is only
// decided right when such items are verified one after the other.
func commitGroups(items []contracts.Allocation) [][]int {
	seen := make(map[string]bool, len(items))
	byNode := map[string][]int{}
	var order []string
	for i, a := range items {
		if seen[a.ID] {
			all := make([]int, len(items))
			for j := range all {
				all[j] = j
			}
			return [][]int{all}
		}
		seen[a.ID] = true
		if _, ok := byNode[a.NodeID]; !ok {
			order = append(order, a.NodeID)
		}
		byNode[a.NodeID] = append(byNode[a.NodeID], i)
	}
	groups := make([][]int, 0, len(order))
	for _, n := range order {
		groups = append(groups, byNode[n])
	}
	return groups
}

// refusalKey is what a plan item's RefusalID is made of: its allocation ID,
// or its index when it has none.
func refusalKey(i int, a contracts.Allocation) string {
	if a.ID == "" {
		return "item-" + strconv.Itoa(i)
	}
	return a.ID
}

// wasRefused reports whether this plan item was refused before.
func (s *server) wasRefused(planID string, i int, a contracts.Allocation) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := refusalHashOf(contracts.RefusalID(planID, refusalKey(i, a)))
	return s.refused.Has(h[:])
}

// refuse publishes the refusal of one plan item, of a plan stored at
// planned, on its tenant's subject.
func (s *server) refuse(ctx context.Context, planID string, i int, a contracts.Allocation, v ledger.Verdict, planned time.Time) error {
	log := s.log.With("plan_id", planID, "alloc_id", a.ID, "node_id", a.NodeID, "tenant", a.Tenant, "reason", string(v.Reason))
	if err := contracts.ValidateTenant(a.Tenant); err != nil {
		// No subject can carry the answer; a scheduler never plans for
		// such a tenant, so this is a hostile or broken plan.
		log.Warn("plan item refused without an answer: invalid tenant", "err", err, "message", v.Message)
		return nil
	}
	key := refusalKey(i, a)
	r := contracts.Refusal{
		SchemaVersion: contracts.SchemaVersion, PlanID: planID, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID,
		// Dated NATS time as last seen (observe), at least its plan's.
		Reason: v.Reason, Message: v.Message, Time: later(s.seen(), planned),
	}
	id := contracts.RefusalID(planID, key)
	// The refusal is about the item's job: in its trace, the plan a link.
	ctx, span := telemetry.StartJobSpan(ctx, s.bus.Tracer(), "refuse "+a.JobID, a.TraceParent,
		telemetry.AllocAttrs(a.Tenant, a.JobID, a.NodeID, a.Attempt)...)
	defer span.End()
	if !s.leading() {
		// A refusal is final for its item: a deposed leader's, judged on
		// what it knew before it froze, must not be the answer.
		return errDeposed
	}
	if _, err := s.bus.Publish(ctx, contracts.SubjectRefused(a.Tenant), id, r, bus.CESubject(a.JobID)); err != nil {
		return err
	}
	s.mu.Lock()
	s.addRefusal(refusalHashOf(id), r.Time)
	s.mu.Unlock()
	log.Debug("plan item refused", "message", v.Message)
	return nil
}
