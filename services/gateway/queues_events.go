package gateway

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/nats-io/nats.go/jetstream"
)

// GET /v1/queues/events streams GET /v1/queues: a "queues" event with the
// whole QueueList as the caller sees it, then another whenever what it
// shows changed. The queues hub below is one change signal shared by
// every stream: a channel closed (and replaced) at each change of what
// the queues are built from - a job event applied to the read model
// (which also moves the fleet hub's placements) or a quota written or
// deleted. A stream holds no history: woken, it waits out
// queuesDebounce (so a burst of job events is one rebuild), builds the
// list again and sends it only when its hash differs from the last one
// sent (the list's time left out), so a change to another tenant's jobs
// sends nothing to a tenant's caller.

// queuesDebounce is the least time between two events of one stream.
const queuesDebounce = 500 * time.Millisecond

// queuesWriteTimeout bounds one event's write to a reader, as the fleet
// stream's does; it is cleared once the event is flushed.
const queuesWriteTimeout = 30 * time.Second

type queuesHub struct {
	mu   sync.Mutex
	wake chan struct{} // closed at the next change
	// waited says some stream took wake (next) since it was made: a
	// change nobody waits for closes and makes nothing (every job event
	// of a burst is one, issue 17).
	waited bool
	// quotas is the quotas bucket as the hub's watch last read it;
	// ready once the watch has read every current value.
	quotas map[string]contracts.TenantQuota
	ready  bool
}

func newQueuesHub() *queuesHub {
	return &queuesHub{wake: make(chan struct{}), quotas: map[string]contracts.TenantQuota{}}
}

// changed wakes every stream.
func (h *queuesHub) changed() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.waited {
		return // nobody holds wake: it stands for the next change still
	}
	close(h.wake)
	h.wake, h.waited = make(chan struct{}), false
}

// next returns a channel closed at the next change.
func (h *queuesHub) next() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.waited = true
	return h.wake
}

// quotasNow returns a copy of the quotas once the watch has read them all.
func (h *queuesHub) quotasNow() (map[string]contracts.TenantQuota, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.ready {
		return nil, false
	}
	return maps.Clone(h.quotas), true
}

// applyQuota folds one entry of the quotas bucket in; a value that does
// not decode leaves the tenant without a quota, as GET /v1/queues shows it.
func (h *queuesHub) applyQuota(e jetstream.KeyValueEntry, log interface{ Warn(string, ...any) }) {
	var q contracts.TenantQuota
	keep := e.Operation() == jetstream.KeyValuePut
	if keep {
		if err := json.Unmarshal(e.Value(), &q); err != nil {
			log.Warn("queues: a stored quota does not decode; the tenant shows without one", "tenant", e.Key(), "revision", e.Revision(), "err", err)
			keep = false
		}
	}
	h.mu.Lock()
	if keep {
		h.quotas[e.Key()] = q
	} else {
		delete(h.quotas, e.Key())
	}
	h.mu.Unlock()
	h.changed()
}

// follow watches the quotas bucket until ctx ends. A watch that cannot
// start leaves the streams reading the bucket at each rebuild (and not
// woken by quota changes): logged, not fatal to the gateway.
func (h *queuesHub) follow(ctx context.Context, b *bus.Bus, log interface{ Warn(string, ...any) }) error {
	err := b.WatchKV(ctx, contracts.BucketQuotas, func(e jetstream.KeyValueEntry) { h.applyQuota(e, log) }, func() {
		h.mu.Lock()
		h.ready = true
		h.mu.Unlock()
		h.changed()
	})
	if err != nil && ctx.Err() == nil {
		log.Warn("queues: the quotas watch stopped; queue streams read the bucket and miss quota changes", "err", err)
	}
	return nil
}

// loadQuotas returns every tenant's quota: the hub's once its watch is
// in, else the bucket as it is now.
func (s *server) loadQuotas(ctx context.Context) (map[string]contracts.TenantQuota, error) {
	if q, ok := s.queues.quotasNow(); ok {
		return q, nil
	}
	kv, err := s.buckets.get(ctx, contracts.BucketQuotas)
	if err != nil {
		return nil, fmt.Errorf("KV bucket %s: %w", contracts.BucketQuotas, err)
	}
	ctx, cancel := context.WithTimeout(ctx, publishTimeout)
	defer cancel()
	entries, err := listDocs(ctx, kv)
	if err != nil {
		return nil, fmt.Errorf("reading the quotas: %w", err)
	}
	out := make(map[string]contracts.TenantQuota, len(entries))
	for _, e := range entries {
		var q contracts.TenantQuota
		if err := json.Unmarshal(e.Value(), &q); err != nil {
			s.log.Warn("queues: skipping a stored quota that does not decode", "tenant", e.Key(), "revision", e.Revision(), "err", err)
			continue
		}
		out[e.Key()] = q
	}
	return out, nil
}

// queuesEvents serves GET /v1/queues/events.
func (s *server) queuesEvents(w http.ResponseWriter, r *http.Request) {
	p, poolFilter, ok := s.queuesRequest(w, r)
	if !ok {
		return
	}
	if !p.isPlatformAdmin() {
		// The route names no tenant: as for the fleet stream, a caller's
		// queue streams are bounded per caller, by the number a tenant's
		// streams are.
		release, ok := s.limits.openStream("queues:" + p.Subject)
		if !ok {
			w.Header().Set("Retry-After", "5")
			writeError(w, http.StatusTooManyRequests, contracts.ReasonTooManyStreams,
				fmt.Sprintf("%s has %d queue streams open, the most a caller may", p.Subject, s.limits.cfg.StreamsPerTenant), nil)
			return
		}
		defer release()
	}
	// The change signal is taken before the first build: a change while
	// it is built wakes the stream again.
	wake := s.queues.next()
	quotas, err := s.loadQuotas(r.Context())
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, err.Error(), nil)
		return
	}
	list, err := s.buildQueues(r.Context(), p, poolFilter, quotas)
	if err != nil {
		s.internalError(w, "read model", err)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(s.streams, cancel)()

	rc := http.NewResponseController(w)
	hd := w.Header()
	hd.Set("Content-Type", "text/event-stream")
	hd.Set("Cache-Control", "no-cache")
	hd.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	write := func(format string, args ...any) bool {
		_ = rc.SetWriteDeadline(time.Now().Add(queuesWriteTimeout))
		if _, err := fmt.Fprintf(w, format, args...); err != nil || rc.Flush() != nil {
			return false
		}
		_ = rc.SetWriteDeadline(time.Time{})
		return true
	}
	var last [sha256.Size]byte
	sent := false
	send := func(l contracts.QueueList) bool {
		// The hash leaves the list's time out: it moves at every build.
		t := l.Time
		l.Time = time.Time{}
		key, err := json.Marshal(l)
		if err != nil {
			s.log.Error("queue list does not encode", "err", err)
			return false
		}
		sum := sha256.Sum256(key)
		if sent && sum == last {
			return true
		}
		l.Time = t
		data, err := json.Marshal(l)
		if err != nil {
			s.log.Error("queue list does not encode", "err", err)
			return false
		}
		sent, last = true, sum
		// The id is the list's time: each event is the whole list, so a
		// reconnect needs no resume point (Last-Event-ID is not read; its
		// first event is the list as it is then).
		return write("event: queues\nid: %d\ndata: %s\n\n", t.UnixMicro(), data)
	}
	if !write(": stream open\n\n") || !send(list) {
		return
	}
	heartbeat := time.NewTicker(s.cfg.Heartbeat)
	defer heartbeat.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-heartbeat.C:
			if !write(": heartbeat\n\n") {
				return
			}
			continue
		case <-wake:
		}
		// Debounce: what changes within the window is one rebuild.
		select {
		case <-ctx.Done():
			return
		case <-time.After(queuesDebounce):
		}
		wake = s.queues.next()
		quotas, err := s.loadQuotas(ctx)
		if err == nil {
			list, err = s.buildQueues(ctx, p, poolFilter, quotas)
		}
		if err != nil {
			// The next change, or the reader's reconnect, tries again.
			s.log.Warn("queues stream: rebuild failed", "subject", p.Subject, "err", err)
			continue
		}
		if !send(list) {
			return
		}
	}
}
