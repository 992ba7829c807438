package state

import (
	"fmt"
	"slices"

	"github.com/gpuplane/gpuplane/contracts"
)

// cardKind is a model of card out of MIG mode in one pool.
type cardKind struct{ pool, model string }

// cardSizes counts the fleet's cards out of MIG mode by kind and
// framebuffer (MiB): what checkShareFits asks, kept up to date as
// inventories come, so a submit never walks the fleet.
type cardSizes map[cardKind]map[int64]int

// migKind is a MIG profile of a model in one pool.
type migKind struct{ pool, model, profile string }

// add counts inv's cards out of MIG mode with weight d (+1 or -1), and
// its MIG instances by kind in mig.
func (c cardSizes) add(mig map[migKind]int, inv *contracts.NodeInventory, d int) {
	if inv == nil {
		return
	}
	for _, g := range inv.GPUs {
		if g.MIGEnabled {
			for _, in := range g.MIGInstances {
				k := migKind{inv.Pool, g.Model, in.Profile}
				if mig[k] += d; mig[k] <= 0 {
					delete(mig, k)
				}
			}
			continue
		}
		k := cardKind{inv.Pool, g.Model}
		m := c[k]
		if m == nil {
			m = map[int64]int{}
			c[k] = m
		}
		if m[g.MemoryMiB] += d; m[g.MemoryMiB] <= 0 {
			delete(m, g.MemoryMiB)
			if len(m) == 0 {
				delete(c, k)
			}
		}
	}
}

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
	var model string
	for k, sizes := range s.cluster.sizes {
		if (req.Pool != "" && k.pool != req.Pool) || (allowed != nil && !slices.Contains(allowed, k.model)) {
			continue
		}
		for mem := range sizes {
			if mem > largest || (mem == largest && k.model < model) {
				largest, model = mem, k.model
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
	msg := fmt.Sprintf("a share of %d MiB is larger than any card it may use: the largest in %s is %s with %d MiB; ask for at most %d MiB, or a whole GPU of a larger model",
		need, scope, model, largest, largest)
	return &contracts.ValidationError{Reason: contracts.ReasonShareTooLarge, Fields: []contracts.FieldError{{
		Field: "resources.gpu.share.memoryMiB", Reason: contracts.ReasonShareTooLarge, Message: msg}}}
}
