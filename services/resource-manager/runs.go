package resourcemanager

import (
	"context"
	"log/slog"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// applyRunFact follows a node agent's run facts: a started run's time is kept
// (a node_lost release reports it), an ended run of a live allocation is
// released carrying its RunResult: applyRunFact returns that release (nil for
// any other fact), which the follow of RUNS runs at once or beside the
// next facts (onRunFact, runs_pipeline.go). Idempotent: an allocation is
// released once; facts of released allocations change nothing. What must
// not be skipped is retried until ctx ends.
func (s *server) applyRunFact(ctx context.Context, m *bus.Msg) (release func()) {
	node := contracts.Token(m.Subject, 2)
	var ev runFact
	if err := m.Decode(&ev); err != nil {
		m.Log(s.log, "node_id", node).Warn("undecodable run event skipped", "err", err)
		return nil
	}
	// Built only when needed (bus.Msg.Log): a rebuild folds every run fact.
	log := func() *slog.Logger { return m.Log(s.log, "node_id", node, "alloc_id", ev.AllocationID) }
	a, live, known := s.allocation(ev.AllocationID)
	if !known {
		// Committed by another replica and not followed yet: read the
		// node's ledger before concluding anything.
		s.retry(ctx, "catch up ledger", func() error { return s.catchUp(ctx, node) })
		a, live, known = s.allocation(ev.AllocationID)
	}
	switch {
	case !known:
		log().Warn("run fact for an allocation the ledger does not know (never committed, or ended more than a plan age ago and forgotten); ignored", "kind", string(ev.Kind))
		return nil
	case a.NodeID != node:
		log().Warn("run fact from a node that does not hold the allocation; ignored", "alloc_node_id", a.NodeID)
		return nil
	case !live:
		return nil
	}
	switch ev.Kind {
	case contracts.RunStarted:
		s.mu.Lock()
		if _, live, _ := s.led.Allocation(ev.AllocationID); live {
			s.started[ev.AllocationID] = ev.Time
		}
		s.mu.Unlock()
	case contracts.RunEnded:
		reason := contracts.ReasonRunEnded
		if ev.Result != nil && ev.Result.Reason == contracts.ReasonCancelled {
			reason = contracts.ReasonCancelled
		}
		// The run has ended: its GPUs must come back, however long the
		// bus takes.
		return func() {
			s.retry(ctx, "release", func() error { return s.release(ctx, ev.AllocationID, reason, ev.Result) })
		}
	}
	return nil
}

// runFact is what the manager reads of a contracts.RunEvent: a rebuild
// decodes every run fact, and the devices, names and process details it
// also carries are not needed (decoding was most of a rebuild's time).
type runFact struct {
	Kind         contracts.RunKind    `json:"kind"`
	AllocationID string               `json:"allocationId"`
	Time         time.Time            `json:"time"`
	Result       *contracts.RunResult `json:"result,omitempty"`
}

func (s *server) allocation(id string) (contracts.Allocation, bool, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.led.Allocation(id)
}

// retry runs fn with backoff until it succeeds or ctx ends. For work a
// follow cannot skip and must not die of (a follow that returns an error
// stops the service).
func (s *server) retry(ctx context.Context, what string, fn func() error) {
	delay := 50 * time.Millisecond
	for {
		err := fn()
		if err == nil || ctx.Err() != nil {
			return
		}
		s.log.Warn(what+" failed; retrying", "err", err, "delay", delay)
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(delay*2, 2*time.Second)
	}
}
