package autoscaler

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/sony/gobreaker/v2"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
)

// actuateEvery is how often the actuator reconciles pools with the provider.
const actuateEvery = time.Second

// holdReasonPrefix marks the drain holds the autoscaler writes, so that it
// lifts only its own and never an administrator's.
const holdReasonPrefix = "autoscaler:"

// runActuation follows the allocation ledger and the last scale decision
// of each pool, and runs the actuator once the ledger is caught up (before
// that every machine would look idle).
func (s *scaler) runActuation(ctx context.Context) error {
	kv, err := s.bus.KeyValue(ctx, contracts.BucketNodeAdmin)
	if err != nil {
		return fmt.Errorf("node admin bucket: %w", err)
	}
	live := &liveAllocations{byNode: map[string]map[string]contracts.Priority{}}
	spot := spotReaction{kv: kv, bus: s.bus, now: s.cfg.Now, log: s.log}
	events := busEvents{bus: s.bus, log: s.log}
	act, err := actuate.New(actuate.Config{Pools: s.cfg.Pools, Provider: s.cfg.Provider, Ledger: live,
		Holds:         kvHolds{kv: kv, now: s.cfg.Now},
		Interruptions: spot,
		Events:        events,
		Nodes:         s.fleet,
		Sweeper: &sweeper{kv: kv, bus: s.bus, spot: spot, events: events, pools: s.cfg.Pools, nodes: s.fleet,
			now: s.cfg.Now, log: s.log},
		LostGrace: s.cfg.NodeLostGrace,
		Breaker:   gobreaker.Settings{Timeout: s.cfg.BreakerOpenFor},
		Now:       s.cfg.Now, Log: s.log})
	if err != nil {
		return err
	}
	s.act.Store(act)
	if w, ok := s.cfg.Provider.(watcher); ok {
		// The provider tells of a notice or a reclaim as it happens: the
		// pool is listed at once, so the drain starts within milliseconds.
		cancel := w.Watch(func(string) { act.Kick() })
		defer cancel()
	}
	errs := make(chan error, 3)
	ledgerReady := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(3)
	go func() {
		defer wg.Done()
		errs <- s.bus.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamAllocations,
			FilterSubjects: []string{contracts.SubjectLedgerAll}}, func(_ context.Context, m *bus.Msg) error {
			var e contracts.LedgerEntry
			if err := m.Decode(&e); err != nil {
				s.log.Warn("skipping ledger entry", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
				return nil
			}
			live.apply(e)
			return nil
		}, func() { close(ledgerReady) })
	}()
	go func() {
		defer wg.Done()
		errs <- s.bus.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectScaleAll}, LastPerSubject: true}, func(_ context.Context, m *bus.Msg) error {
			var d contracts.ScaleDecision
			if err := m.Decode(&d); err != nil {
				s.log.Warn("skipping decision", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
				return nil
			}
			d.Pool = contracts.Token(m.Subject, 3)
			if _, managed := s.cfg.Pools[d.Pool]; !managed {
				// Decided by an autoscaler without a provider, or before
				// this one's pools were configured: a pool it does not
				// manage is normal, read again at every term's replay.
				s.log.Debug("decision for a pool without a scaling policy: not acted on", "pool", d.Pool, "id", d.ID)
				return nil
			}
			if err := act.Apply(d); err != nil {
				s.log.Warn("decision not acted on", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
			}
			return nil
		}, nil)
	}()
	go func() {
		defer wg.Done()
		select {
		case <-ctx.Done():
			errs <- nil
			return
		case <-ledgerReady:
		}
		every := s.cfg.ActuateEvery
		if every <= 0 {
			every = actuateEvery
		}
		errs <- act.Run(ctx, every)
	}()
	var first error
	for range 3 {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	wg.Wait()
	return first
}

// liveAllocations folds the ledger into the live allocations of each node.
// Entries are keyed by allocation ID, so applying one twice is harmless.
type liveAllocations struct {
	mu     sync.Mutex
	byNode map[string]map[string]contracts.Priority // node → allocation ID → priority
}

var _ actuate.Ledger = (*liveAllocations)(nil)

func (l *liveAllocations) apply(e contracts.LedgerEntry) {
	a := e.Allocation
	l.mu.Lock()
	defer l.mu.Unlock()
	switch e.Kind {
	case contracts.LedgerCommitted:
		if l.byNode[a.NodeID] == nil {
			l.byNode[a.NodeID] = map[string]contracts.Priority{}
		}
		l.byNode[a.NodeID][a.ID] = a.Priority
	case contracts.LedgerReleased:
		delete(l.byNode[a.NodeID], a.ID)
	}
}

func (l *liveAllocations) Live(node string) []contracts.Priority {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []contracts.Priority
	for _, p := range l.byNode[node] {
		out = append(out, p)
	}
	return out
}

// kvHolds writes drain holds as NodeAdmin documents in BucketNodeAdmin.
type kvHolds struct {
	kv  jetstream.KeyValue
	now func() time.Time
}

var _ actuate.Holds = kvHolds{}

// Drain cordons and drains a node before its machine is deleted. A node
// already cordoned or drained by someone else is left as it is (that hold
// keeps new work off, and deletion waits for the ledger to be empty
// anyway); holds on single GPUs are kept.
func (h kvHolds) Drain(ctx context.Context, node, reason string) error {
	if !strings.HasPrefix(reason, holdReasonPrefix) {
		reason = holdReasonPrefix + " " + reason
	}
	return bus.UpdateNodeAdmin(ctx, h.kv, node, h.now(), func(na *contracts.NodeAdmin) bool {
		if na.Cordoned || na.Drain {
			return false
		}
		na.Cordoned, na.Drain, na.Reason = true, true, reason
		return true
	})
}

// Lift removes the node-level hold the autoscaler wrote, and only that:
// a hold an administrator wrote meanwhile, and holds on single GPUs, stay.
func (h kvHolds) Lift(ctx context.Context, node string) error {
	err := bus.UpdateNodeAdmin(ctx, h.kv, node, h.now(), func(na *contracts.NodeAdmin) bool {
		if !strings.HasPrefix(na.Reason, holdReasonPrefix) {
			return false
		}
		na.Cordoned, na.Drain, na.Reason = false, false, ""
		return true
	})
	if errors.Is(err, bus.ErrUnreadableHold) {
		return nil // not a document the autoscaler wrote
	}
	return err
}
