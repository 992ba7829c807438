package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// GET /v1/ops/events streams what an operator watches: alerts firing and
// resolved, scale decisions and machine events (the OPS stream), and
// migrations and preemptions (job events). The ops hub is one shared tail
// of each: OPS is read once here, and the job events come from the read
// model's own tail (ingest.go), so a stream costs no consumer on the bus.
// The hub keeps the latest opsRingSize events, shared by every stream; a
// stream gets those after its Last-Event-ID (all of them without one),
// then each new one through a buffer of opsSubBuffer events. A reader
// that lets its buffer fill is dropped with a final "dropped" event
// rather than held: it reconnects with its Last-Event-ID.
//
// An event's id is its message's timestamp in microseconds, made strictly
// increasing in the order the hub takes events in, so ids survive a
// restart of the gateway (which reads the streams again) and mean the
// same on every replica, but for ties.

const (
	opsRingSize  = 2000
	opsSubBuffer = 256
)

type opsItem struct {
	id uint64
	ev contracts.OpsEvent
}

type opsHub struct {
	mu    sync.Mutex
	clock uint64
	ring  []opsItem // oldest first, at most opsRingSize
	subs  map[*opsSub]struct{}
}

type opsSub struct {
	c       chan opsItem
	dropped chan struct{}
}

func newOpsHub() *opsHub { return &opsHub{subs: map[*opsSub]struct{}{}} }

// add records ev at time t and hands it to every stream.
func (h *opsHub) add(t time.Time, ev contracts.OpsEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	id := uint64(t.UnixMicro())
	if id <= h.clock {
		id = h.clock + 1
	}
	h.clock = id
	it := opsItem{id: id, ev: ev}
	if len(h.ring) >= opsRingSize {
		h.ring = slices.Delete(h.ring, 0, len(h.ring)-opsRingSize+1)
	}
	h.ring = append(h.ring, it)
	for s := range h.subs {
		select {
		case s.c <- it:
		default:
			// Too slow: its stream ends with a dropped event.
			delete(h.subs, s)
			close(s.dropped)
		}
	}
}

// subscribe returns the events after id held now and a subscription to
// the later ones.
func (h *opsHub) subscribe(after uint64) ([]opsItem, *opsSub, func()) {
	s := &opsSub{c: make(chan opsItem, opsSubBuffer), dropped: make(chan struct{})}
	h.mu.Lock()
	defer h.mu.Unlock()
	i, _ := slices.BinarySearchFunc(h.ring, after+1, func(it opsItem, id uint64) int {
		switch {
		case it.id < id:
			return -1
		case it.id > id:
			return 1
		}
		return 0
	})
	backlog := slices.Clone(h.ring[i:])
	h.subs[s] = struct{}{}
	return backlog, s, func() {
		h.mu.Lock()
		delete(h.subs, s)
		h.mu.Unlock()
	}
}

// opsKind says whether a job event is one of the ops view's (a
// migration or preemption), and as what.
func opsKind(ev contracts.JobEvent) (typ, what string, ok bool) {
	switch {
	case ev.Type == contracts.EventMigrating || ev.Type == contracts.EventMigrated:
		return contracts.OpsMigration, string(ev.Type), true
	case ev.Reason == contracts.ReasonPreempted && (ev.Type == contracts.EventRequeued || ev.Type == contracts.EventFailed ||
		ev.Type == contracts.EventCancelled):
		return contracts.OpsPreemption, "preempted (" + string(ev.Type) + ")", true
	}
	return "", "", false
}

// observeJob takes a migration or preemption from the job events.
func (h *opsHub) observeJob(ev contracts.JobEvent) {
	typ, what, ok := opsKind(ev)
	if !ok {
		return
	}
	out := contracts.OpsEvent{Type: typ, Jobs: []contracts.JobRef{{Tenant: ev.Tenant, JobID: ev.JobID}}, Job: &ev, Time: ev.Time}
	var nodes []string
	addNodes := func(ps []contracts.Placement) {
		for _, p := range ps {
			if p.NodeID != "" && !slices.Contains(nodes, p.NodeID) {
				nodes = append(nodes, p.NodeID)
			}
			if out.Pool == "" {
				out.Pool = p.Pool
			}
		}
	}
	if ev.Migration != nil {
		addNodes(ev.Migration.From)
	}
	if ev.Placement != nil {
		addNodes([]contracts.Placement{*ev.Placement})
	}
	addNodes(ev.Placements)
	out.Nodes = nodes
	out.Summary = fmt.Sprintf("job %s/%s %s", ev.Tenant, ev.JobID, what)
	if ev.Migration != nil && ev.Migration.Reason != "" {
		out.Summary += ": " + string(ev.Migration.Reason)
	} else if ev.Message != "" {
		out.Summary += ": " + ev.Message
	}
	h.add(ev.Time, out)
}

// applyOps takes one OPS message (alerts, scale decisions, machine
// events); one it cannot read is skipped.
func (h *opsHub) applyOps(m *bus.Msg) error {
	var out contracts.OpsEvent
	switch contracts.Token(m.Subject, 1) {
	case "alerts":
		var a contracts.Alert
		if err := m.Decode(&a); err != nil {
			return err
		}
		out = contracts.OpsEvent{Type: contracts.OpsAlert, Alert: &a, Time: a.Time,
			Summary: fmt.Sprintf("%s %s %s: %s", a.Severity, a.Kind, a.State, a.Message)}
		out.Pool = a.Labels["pool"]
		for _, k := range []string{"node", "nodeId", "node_id"} {
			if n := a.Labels[k]; n != "" {
				out.Nodes = []string{n}
				break
			}
		}
		if t, j := a.Labels["tenant"], a.Labels["job"]; t != "" && j != "" {
			out.Jobs = []contracts.JobRef{{Tenant: t, JobID: j}}
		}
	case "autoscale":
		switch contracts.Token(m.Subject, 2) {
		case "decisions":
			var d contracts.ScaleDecision
			if err := m.Decode(&d); err != nil {
				return err
			}
			out = contracts.OpsEvent{Type: contracts.OpsScale, Scale: &d, Pool: d.Pool, Time: d.Time,
				Summary: fmt.Sprintf("pool %s: scale %s %d → %d nodes: %s", d.Pool, d.Direction, d.CurrentNodes, d.DesiredNodes, d.Reason)}
		case "machines":
			var e contracts.MachineEvent
			if err := m.Decode(&e); err != nil {
				return err
			}
			out = contracts.OpsEvent{Type: contracts.OpsMachine, Machine: &e, Pool: e.Pool, Time: e.Time,
				Summary: strings.TrimSpace(fmt.Sprintf("pool %s: machine %s %s %s", e.Pool, cmpOr(e.MachineID, e.NodeID, e.Token), e.Kind, e.Message))}
			if e.NodeID != "" {
				out.Nodes = []string{e.NodeID}
			}
		default:
			return nil
		}
	default:
		return nil
	}
	if out.Time.IsZero() {
		out.Time = m.Timestamp
	}
	h.add(m.Timestamp, out)
	return nil
}

func cmpOr(vals ...string) string {
	for _, v := range vals {
		if v != "" {
			return v
		}
	}
	return ""
}

// follow reads the OPS stream's alerts, scale decisions and machine
// events from the start (the stream keeps a week) until ctx ends; ready
// is called once it has caught up.
func (h *opsHub) follow(ctx context.Context, b *bus.Bus, log interface{ Warn(string, ...any) }, ready func()) error {
	spec := bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectAlertsAll, contracts.SubjectScaleAll, contracts.SubjectMachinesAll}}
	err := b.Follow(ctx, spec, func(_ context.Context, m *bus.Msg) error {
		if err := h.applyOps(m); err != nil {
			log.Warn("ops: skipping a message that does not decode", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		}
		return nil
	}, ready)
	if err != nil && ctx.Err() == nil {
		// The rest of the gateway does not depend on it: GET
		// /v1/ops/events answers 503 until the gateway restarts.
		log.Warn("ops: reading OPS stopped", "err", err)
	}
	return nil
}

// opsEvents serves GET /v1/ops/events.
func (s *server) opsEvents(w http.ResponseWriter, r *http.Request) {
	after, ok := lastEventID(w, r)
	if !ok || !s.modelReady(w) {
		return
	}
	if !s.opsReady() {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, "the OPS stream is still being read; retry shortly", nil)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(s.streams, cancel)()
	backlog, sub, unsubscribe := s.ops.subscribe(after)
	defer unsubscribe()

	rc := http.NewResponseController(w)
	hd := w.Header()
	hd.Set("Content-Type", "text/event-stream")
	hd.Set("Cache-Control", "no-cache")
	hd.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	last := after
	send := func(it opsItem) bool {
		if it.id <= last {
			return true
		}
		data, err := json.Marshal(it.ev)
		if err != nil {
			s.log.Error("ops event does not encode", "err", err)
			return true
		}
		last = it.id
		_, err = fmt.Fprintf(w, "event: %s\nid: %d\ndata: %s\n\n", it.ev.Type, it.id, data)
		return err == nil
	}
	// Each write (with its flush) has fleetWriteTimeout: a reader whose
	// connection takes nothing is cut off rather than holding the handler.
	// The deadline is cleared after each flush, so an idle stream lives.
	begin := func() { _ = rc.SetWriteDeadline(time.Now().Add(fleetWriteTimeout)) }
	flush := func() bool {
		if rc.Flush() != nil {
			return false
		}
		_ = rc.SetWriteDeadline(time.Time{})
		return true
	}
	begin()
	if _, err := fmt.Fprint(w, ": stream open\n\n"); err != nil {
		return
	}
	for _, it := range backlog {
		if !send(it) {
			return
		}
	}
	if !flush() {
		return
	}
	heartbeat := time.NewTicker(s.cfg.Heartbeat)
	defer heartbeat.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-heartbeat.C:
			begin()
			if _, err := fmt.Fprint(w, ": heartbeat\n\n"); err != nil || !flush() {
				return
			}
		case it := <-sub.c:
			begin()
			if !send(it) || !flush() {
				return
			}
		case <-sub.dropped:
			begin()
			// What the buffer still holds goes out first: the dropped
			// event's id is then the last one delivered.
			for {
				select {
				case it := <-sub.c:
					if !send(it) {
						return
					}
					continue
				default:
				}
				break
			}
			ev := contracts.OpsEvent{Type: contracts.OpsDropped, Time: s.now().UTC(),
				Summary: fmt.Sprintf("this stream fell more than %d events behind and was ended; reconnect with Last-Event-ID %d", opsSubBuffer, last)}
			data, _ := json.Marshal(ev)
			_, _ = fmt.Fprintf(w, "event: %s\nid: %d\ndata: %s\n\n", ev.Type, last, data)
			_ = flush()
			s.log.Info("ops stream dropped: reader too slow", "last_id", last)
			return
		}
	}
}
