package autoscaler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/internal/actuate"
)

// sweeper lifts the holds that machines gone while the autoscaler was not
// watching left behind (reclaimed or deleted during a restart): the live
// path only sees a machine leave a list it saw before. A hold is the
// autoscaler's business when it wrote it (reason prefix) or when it carries
// the spot cause; it is swept when its node belongs to a managed pool and
// no pool's list shows the node any more. A spot hold is released as the
// live path does it (spotReaction.Gone: alert resolved under the same
// Nats-Msg-Id) and followed by the same `reclaimed` machine event, so a
// sweep repeating what the live path already did is dropped by JetStream.
// It runs until one sweep succeeds (the first complete step after start).
type sweeper struct {
	kv     jetstream.KeyValue
	bus    *bus.Bus
	spot   spotReaction
	events busEvents
	pools  map[string]Pool
	nodes  interface {
		PoolOf(nodeID string) (string, bool)
	}
	now func() time.Time
	log *slog.Logger

	mu      sync.Mutex
	index   map[string]machineRef // node → its machine, from machine events
	indexed time.Time             // when index was last rebuilt
	swept   bool                  // a sweep went through: the live path sees the rest
}

var _ actuate.Sweeper = (*sweeper)(nil)

// machineRef is a node's machine as the autoscaler's machine events name it.
type machineRef struct{ pool, machine string }

// reindexEvery bounds how often a hold whose node no machine event names
// makes the machine events be read again.
const reindexEvery = time.Minute

func (s *sweeper) Sweep(ctx context.Context, live map[string][]string) error {
	// Once a sweep went through, every later departure is seen live
	// (the actuator diffs the provider's lists): reading the whole bucket
	// every step would be I/O for nothing.
	s.mu.Lock()
	done := s.swept
	s.mu.Unlock()
	if done {
		return nil
	}
	if err := s.sweep(ctx, live); err != nil {
		return err
	}
	s.mu.Lock()
	s.swept = true
	s.mu.Unlock()
	return nil
}

func (s *sweeper) sweep(ctx context.Context, live map[string][]string) error {
	listed := map[string]bool{}
	for _, nodes := range live {
		for _, n := range nodes {
			listed[n] = true
		}
	}
	keys, err := s.kv.Keys(ctx)
	if errors.Is(err, jetstream.ErrNoKeysFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list holds: %w", err)
	}
	var errs []error
	for _, node := range keys {
		if listed[node] {
			continue
		}
		e, err := s.kv.Get(ctx, node)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("read hold of %s: %w", node, err))
			continue
		}
		var na contracts.NodeAdmin
		if json.Unmarshal(e.Value(), &na) != nil {
			continue // not ours to judge
		}
		spot := na.Cause == contracts.ReasonSpotInterruption && na.Deadline != nil
		if !spot && !strings.HasPrefix(na.Reason, holdReasonPrefix) {
			continue // an administrator's hold
		}
		ref, err := s.locate(ctx, node)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if _, managed := live[ref.pool]; !managed {
			continue
		}
		if !spot {
			// The autoscaler's scale-down drain of a machine it deleted.
			if err := (kvHolds{kv: s.kv, now: s.now}).Lift(ctx, node); err != nil {
				errs = append(errs, err)
			} else {
				s.log.Info("lifted the drain hold of a machine gone", "pool", ref.pool, "node_id", node)
			}
			continue
		}
		m := cloud.Machine{ID: ref.machine, NodeID: node, Pool: ref.pool, Interruption: na.Deadline.UTC()}
		if err := s.spot.Gone(ctx, m); err != nil {
			errs = append(errs, err)
			continue
		}
		at := m.Interruption
		s.events.MachineEvent(ctx, contracts.MachineEvent{SchemaVersion: contracts.SchemaVersion, Kind: contracts.MachineReclaimed,
			Pool: ref.pool, MachineID: m.ID, NodeID: node, Deadline: &at, Time: s.now(),
			Message: "the provider took the machine back (found gone at start)"})
		s.log.Info("machine reclaimed while unwatched: hold released, alert resolved", "pool", ref.pool, "machine", m.ID, "node_id", node)
	}
	return errors.Join(errs...)
}

// locate finds the pool and machine of node: from the autoscaler's own
// machine events (they name both), else from the node's inventory (the
// machine ID is then taken to be the node ID, as it is for simcloud).
func (s *sweeper) locate(ctx context.Context, node string) (machineRef, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ref, ok := s.index[node]; ok {
		return ref, nil
	}
	if s.index == nil || s.now().Sub(s.indexed) >= reindexEvery {
		index := map[string]machineRef{}
		_, err := s.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamOps,
			FilterSubjects: []string{contracts.SubjectMachinesAll}}, func(_ context.Context, m *bus.Msg) error {
			var e contracts.MachineEvent
			if m.Decode(&e) != nil || e.NodeID == "" || e.MachineID == "" {
				return nil
			}
			if pool := contracts.Token(m.Subject, 3); hasPool(s.pools, pool) {
				index[e.NodeID] = machineRef{pool: pool, machine: e.MachineID}
			}
			return nil
		})
		if err != nil {
			return machineRef{}, fmt.Errorf("read machine events: %w", err)
		}
		s.index, s.indexed = index, s.now()
		if ref, ok := index[node]; ok {
			return ref, nil
		}
	}
	if pool, ok := s.nodes.PoolOf(node); ok {
		return machineRef{pool: pool, machine: node}, nil
	}
	return machineRef{}, nil
}

func hasPool(pools map[string]Pool, name string) bool {
	_, ok := pools[name]
	return ok
}
