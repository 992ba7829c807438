package resourcemanager

import (
	"context"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// Cordon and drain: administrators hold a node in contracts.BucketNodeAdmin
// (one NodeAdmin per node ID). The scheduler stops planning for a held node,
// but a plan already in flight, or one from a scheduler that has not seen
// the hold yet, must not put new work there either: the resource manager
// refuses it (node_cordoned), checked under the node lock right before each
// compare-and-set, like every other verdict. What the node already holds is
// untouched here: releases go on, and moving a drained node's jobs off is
// the scheduler's (preemption's) work. The same record may hold single GPUs
// (NodeAdmin.GPUs: the scheduler's holds for sick or hot GPUs, or an
// administrator's): an item with any device on a held GPU, a MIG instance
// or a share of it included, is refused the same way, naming the GPU.
//
// A hold written while a commit to the node is between its check and its
// compare-and-set does not stop that commit: a cordon means "nothing new
// from now on", and the drain moves whatever landed.

// watchNodeAdmin follows the node admin bucket for as long as ctx lives;
// ready is called once the holds present at start are applied, so no plan
// is judged before they are known.
func (s *server) watchNodeAdmin(ctx context.Context, ready func()) error {
	return s.bus.WatchKV(ctx, contracts.BucketNodeAdmin, s.applyNodeAdmin, ready)
}

// applyNodeAdmin records the hold a key now says; a deleted or purged key
// lifts it. The key names the node, whatever the value says. A value that
// cannot be read holds the node (fail closed): an administrator meant
// something by it, and a refused plan is retried where a job put on a node
// being serviced is not easily undone.
func (s *server) applyNodeAdmin(e jetstream.KeyValueEntry) {
	node := e.Key()
	log := s.log.With("node_id", node, "kv_revision", e.Revision())
	if err := contracts.ValidateID(node); err != nil {
		log.Warn("node admin key is not a node ID; ignored", "err", err)
		return
	}
	ad := contracts.NodeAdmin{NodeID: node}
	if e.Operation() == jetstream.KeyValuePut {
		var err error
		if ad, err = contracts.DecodeNodeAdmin(node, e.Value()); err != nil {
			log.Error("unreadable node admin record: node held as cordoned until it is fixed", "err", err)
		}
	}
	s.mu.Lock()
	s.led.SetAdmin(node, ad)
	s.mu.Unlock()
	log.Info("node admin hold applied", "cordoned", ad.Cordoned, "drain", ad.Drain, "cause", ad.Cause, "reason", ad.Reason, "gpu_holds", len(ad.GPUs))
}
