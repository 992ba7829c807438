package resourcemanager

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/ledger"
)

// Fencing: a scheduler leads under a lease in contracts.BucketLeases whose
// epoch grows with each change of leader. The resource manager keeps the
// highest epoch it has seen per scheduler (from the lease, or from a plan,
// whichever comes first) and refuses plan items stamped with a lower one:
// a deposed leader's late plans never commit. A scheduler no lease was ever
// seen for is not fenced (single-instance setups without a lease; plans
// with epoch 0), but once one exists an epoch-0 plan is refused too.

// observeEpoch raises scheduler's highest known epoch to epoch. Under s.mu.
func (s *server) observeEpoch(scheduler string, epoch uint64) {
	if epoch > s.epochs[scheduler] {
		s.epochs[scheduler] = epoch
	}
}

// fenceCheck refuses an item of scheduler's plan at epoch when a newer
// epoch is known. Under s.mu.
func (s *server) fenceCheck(scheduler string, epoch uint64) (ledger.Verdict, bool) {
	hi, known := s.epochs[scheduler]
	switch {
	case !known || epoch >= hi:
		return ledger.Verdict{}, true
	case epoch == 0:
		return ledger.Verdict{Reason: contracts.RefusedStaleEpoch, Message: fmt.Sprintf(
			"plan of scheduler %q carries no epoch, but that scheduler elects a leader (epoch %d): only the lease holder may plan",
			scheduler, hi)}, false
	default:
		return ledger.Verdict{Reason: contracts.RefusedStaleEpoch, Message: fmt.Sprintf(
			"plan of scheduler %q has epoch %d, but epoch %d has taken over: the plan comes from a deposed leader",
			scheduler, epoch, hi)}, false
	}
}

// watchLeases follows the lease bucket for as long as ctx lives; ready is
// called once the values present at start are applied, so no plan is
// judged before the current epochs are known.
func (s *server) watchLeases(ctx context.Context, ready func()) error {
	return s.bus.WatchKV(ctx, contracts.BucketLeases, s.applyLease, ready)
}

// applyLease raises the epoch of the scheduler a lease names.
func (s *server) applyLease(e jetstream.KeyValueEntry) {
	name, isSched := strings.CutPrefix(e.Key(), "scheduler.")
	if !isSched || e.Operation() != jetstream.KeyValuePut {
		return
	}
	var l contracts.Lease
	if err := json.Unmarshal(e.Value(), &l); err != nil {
		s.log.Error("unreadable lease skipped", "key", e.Key(), "err", err)
		return
	}
	s.mu.Lock()
	s.observeEpoch(name, l.Epoch)
	s.mu.Unlock()
}
