package resourcemanager

import (
	"context"
	"strconv"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
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
	var committed, duplicate, refused int
	for i, item := range p.Items {
		if item.PlanID == "" {
			item.PlanID = p.ID
		}
		if item.Scheduler == "" {
			item.Scheduler = p.Scheduler
		}
		v, err := s.commit(ctx, item)
		if err != nil {
			log.Warn("plan item not settled; plan will be redelivered", "alloc_id", item.ID, "err", err)
			return err
		}
		switch {
		case v.Refused():
			refused++
			if err := s.refuse(ctx, planID, i, item, v); err != nil {
				return err
			}
		case v.Duplicate:
			duplicate++
		default:
			committed++
		}
		if i%64 == 63 {
			_ = m.InProgress() // a long plan must not outlive AckWait
		}
	}
	log.Info("plan settled", "items", len(p.Items), "committed", committed, "duplicate", duplicate, "refused", refused)
	return nil
}

// refuse publishes the refusal of one plan item on its tenant's subject.
func (s *server) refuse(ctx context.Context, planID string, i int, a contracts.Allocation, v ledger.Verdict) error {
	log := s.log.With("plan_id", planID, "alloc_id", a.ID, "node_id", a.NodeID, "tenant", a.Tenant, "reason", string(v.Reason))
	if err := contracts.ValidateTenant(a.Tenant); err != nil {
		// No subject can carry the answer; a scheduler never plans for
		// such a tenant, so this is a hostile or broken plan.
		log.Warn("plan item refused without an answer: invalid tenant", "err", err, "message", v.Message)
		return nil
	}
	key := a.ID
	if key == "" {
		key = "item-" + strconv.Itoa(i)
	}
	r := contracts.Refusal{
		SchemaVersion: contracts.SchemaVersion, PlanID: planID, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: a.NodeID,
		Reason: v.Reason, Message: v.Message, Time: s.cfg.Now(),
	}
	if _, err := s.bus.Publish(ctx, contracts.SubjectRefused(a.Tenant), contracts.RefusalID(planID, key), r, bus.CESubject(a.JobID)); err != nil {
		return err
	}
	log.Debug("plan item refused", "message", v.Message)
	return nil
}
