package monitor

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/lease"
)

// Replicas: every replica follows every stream into its own read model and
// serves the whole of /metrics (Prometheus scrapes each, told apart by its
// instance label), and feeds the rules' windows with the same samples.
// Only the holder of the lease contracts.LeaseKeyMonitor evaluates the
// rules and the silence detector and publishes their alerts. Episodes are
// numbered by the engine, and an alert's message ID carries its episode:
// two replicas publishing would number an episode one of them saw and the
// other did not (a flap at a threshold, a replica started later)
// differently, and the autoscaler adds a machine per scale_up episode. A
// standby folds the leader's alerts into its engine as they are published
// (the same Restore a restart replays), so when it takes over, at most
// LeaseTTL after the leader stops renewing, its windows are warm, its
// episodes continue the leader's, and its first evaluation publishes what
// changed while no one led. A leader frozen past its lease checks its term
// before each evaluation and publishes nothing once it is over.

// contend holds the alerting lease whenever it can until ctx ends.
func (m *monitor) contend(ctx context.Context) error {
	kv, err := m.bus.KeyValue(ctx, contracts.BucketLeases)
	if err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	holder := m.cfg.Instance + "-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	e, err := lease.New(lease.Config{KV: kv, Key: contracts.LeaseKeyMonitor, Holder: holder, TTL: m.cfg.LeaseTTL, Log: m.log})
	if err != nil {
		return fmt.Errorf("%s: %w", Name, err)
	}
	return e.Run(ctx, func(ctx context.Context, t lease.Term) error {
		m.term.Store(&t)
		defer m.term.Store(nil)
		<-ctx.Done()
		return nil
	})
}

// alerting reports whether this replica publishes alerts now: always
// without election, while its term is valid with one.
func (m *monitor) alerting() bool {
	if m.cfg.LeaseTTL == 0 {
		return true
	}
	t := m.term.Load()
	return t != nil && t.Valid()
}

// onLeaderAlert folds an alert the leader published into a standby's
// engine; the leader's own come back to it and change nothing it does not
// know, so they are skipped.
func (m *monitor) onLeaderAlert(msg *bus.Msg) error {
	if !m.alerting() {
		m.restoreAlert(msg)
	}
	return nil
}
