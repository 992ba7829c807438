package state

import (
	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// failCache remembers, for the rest of a cycle, the failures of requests
// by everything their placement reads: the placer's failure-memo key
// (shape, counts, host resources: RequestMemo.Key), the exclusions' key,
// and what the pool verdicts read (tenant and need, through the cycle's
// admit, which has no other input until the book changes). While the
// placer's Epoch stays (no node's capacity moved) and the book does not
// change (bookChanged clears it), a request with the same ask fails with
// the same explanation and the same quota notes: Place would find the
// failure in its own memo (failedBefore) after deriving the key and
// asking every pool's verdict again; here one look-up does. ~86,000 of a
// steady cycle's 100,000 queued jobs wait, most behind a few dozen asks.
//
// Only requests placement memoises (Memoable) with no per-pool runtime
// check (PoolRuns, a closure per job) and no caller text (Extra) are
// remembered; the queue text (jobs ahead, tenant) is the job's own, put
// back on the remembered explanation (QueueText).
type failCache struct {
	epoch int
	asks  map[failAsk]failAnswer
	hits  *int // the store's count of failures answered here (tests)
}

type failAsk struct {
	key, exclude, tenant string
	need                 int64
}

type failAnswer struct {
	pending placement.Pending // the explanation without the queue text
	quota   []string          // the quota notes the verdicts added
}

// cycleFails is a cycle's empty cache.
func (s *Store) cycleFails() *failCache {
	return &failCache{epoch: -1, asks: map[failAsk]failAnswer{}, hits: &s.cycleBufs.failHits}
}

func (f *failCache) clear() { clear(f.asks) }

// place is p.PlaceMemo(r, m), or the remembered failure of r's ask. quota
// holds the cycle's quota notes for the job (admit appends to it): on a
// remembered failure it is set to the notes the first asker's got.
func (f *failCache) place(p *placement.Placer, r *placement.Request, m *placement.RequestMemo, need int64,
	quota *[]string) placement.Decision {
	if r.PoolRuns != nil || r.Extra != "" || !placement.Memoable(r) {
		return p.PlaceMemo(r, m)
	}
	if e := p.Epoch(); e != f.epoch {
		clear(f.asks)
		f.epoch = e
	}
	ask := failAsk{key: m.Key(), exclude: r.ExcludeKey, tenant: r.Tenant, need: need}
	if ask.key != "" {
		if a, ok := f.asks[ask]; ok {
			*quota = append((*quota)[:0], a.quota...)
			*f.hits++
			return placement.Decision{Pending: p.QueueText(a.pending, r)}
		}
	}
	d := p.PlaceMemo(r, m)
	// A malformed request's refusal is not its key's; a placement moves
	// the epoch (and is not a failure).
	if d.Placed() || d.Pending.Code == contracts.ReasonUnsatisfiable || p.Epoch() != f.epoch {
		return d
	}
	if ask.key = m.Key(); ask.key == "" {
		return d // placement keyed nothing
	}
	if pd, ok := p.Explanation(d.Pending, r); ok {
		if len(f.asks) > 1<<16 {
			clear(f.asks) // only an optimisation: forgetting is safe
		}
		f.asks[ask] = failAnswer{pending: pd, quota: append([]string(nil), *quota...)}
	}
	return d
}
