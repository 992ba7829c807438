package resourcemanager

import (
	"context"
	"sync"

	"github.com/gpuplane/gpuplane/contracts"
)

// jobGate lets plans be handled at once (Config.PlanWorkers) only when
// they name no job in common. Two plans for one job (a plan published
// again after a publish that timed out but was stored, or a deposed
// leader's beside its successor's) are decided one after the other, as
// when plans went one at a time: the ledger's "job already holds another
// allocation" check sees only what has been applied, and each part of a
// gang is verified under its own node's lock, so two plans of one gang
// on different machines, verified at once, could both pass and leave the
// job split over both placements (one part on each, each naming the
// other's peers). A plan enters with all its jobs or waits, so no two
// plans can wait for each other.
type jobGate struct {
	mu   sync.Mutex
	busy map[string]chan struct{} // job key -> closed when its plan leaves
}

// enter waits until no plan in flight names any of keys, then holds them
// until leave is called, or returns ctx's error.
func (g *jobGate) enter(ctx context.Context, keys []string) (leave func(), err error) {
	for {
		g.mu.Lock()
		if g.busy == nil {
			g.busy = map[string]chan struct{}{}
		}
		var wait chan struct{}
		for _, k := range keys {
			if ch, ok := g.busy[k]; ok {
				wait = ch
				break
			}
		}
		if wait == nil {
			done := make(chan struct{})
			for _, k := range keys {
				g.busy[k] = done
			}
			g.mu.Unlock()
			return func() {
				g.mu.Lock()
				for _, k := range keys {
					if g.busy[k] == done {
						delete(g.busy, k)
					}
				}
				g.mu.Unlock()
				close(done)
			}, nil
		}
		g.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// inFlight is how many jobs plans in flight hold (tests).
func (g *jobGate) inFlight() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.busy)
}

// planJobs are the keys of the jobs a plan's items are for.
func planJobs(items []contracts.Allocation) []string {
	seen := make(map[string]bool, len(items))
	keys := make([]string, 0, len(items))
	for _, a := range items {
		k := a.Tenant + "/" + a.JobID
		if !seen[k] {
			seen[k] = true
			keys = append(keys, k)
		}
	}
	return keys
}
