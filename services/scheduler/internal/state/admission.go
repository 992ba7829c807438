package state

import (
	"fmt"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
)

// checkShareFits refuses a share that no card of the fleet the request may
// use (its pool, its models, out of MIG mode) could ever hold: as Slurm
// rejects an impossible request at submit, rather than leaving it pending
// (--share 30Gi on 23 GiB L4s). Only the fleet knows a card's framebuffer,
// so this is the scheduler's check, not contracts' validation. A request
// whose scope has no such card yet (no node registered, only MIG cards) is
// accepted: capacity may come.
func (s *Store) checkShareFits(req contracts.JobRequest) error {
	g := req.Resources.GPU
	if g.Share == nil {
		return nil
	}
	need := max(g.Share.MemoryMiB, g.MemoryMiB)
	allowed := g.AllowedModels()
	var largest int64 = -1
	var model, node string
	for _, id := range s.cluster.ids {
		n := s.cluster.nodes[id]
		if n.inv == nil || (req.Pool != "" && n.inv.Pool != req.Pool) {
			continue
		}
		for _, c := range n.inv.GPUs {
			if c.MIGEnabled || (allowed != nil && !slices.Contains(allowed, c.Model)) {
				continue
			}
			if c.MemoryMiB > largest {
				largest, model, node = c.MemoryMiB, c.Model, id
			}
		}
	}
	if largest < 0 || largest >= need {
		return nil
	}
	scope := "the fleet"
	if req.Pool != "" {
		scope = "pool " + req.Pool
	}
	msg := fmt.Sprintf("a share of %d MiB is larger than any card it may use: the largest in %s is %s with %d MiB (on %s); ask for at most %d MiB, or a whole GPU of a larger model",
		need, scope, model, largest, node, largest)
	return &contracts.ValidationError{Reason: contracts.ReasonShareTooLarge, Fields: []contracts.FieldError{{
		Field: "resources.gpu.share.memoryMiB", Reason: contracts.ReasonShareTooLarge, Message: msg}}}
}
