package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func (h *harness) publishOps(subject, id string, v any) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, subject, id, v); err != nil {
		h.t.Fatalf("publish %s: %v", subject, err)
	}
}

// opsEvents reads n events of an ops stream.
func opsEvents(t *testing.T, frames <-chan sseFrame, n int) ([]contracts.OpsEvent, []string) {
	t.Helper()
	var evs []contracts.OpsEvent
	var ids []string
	for len(evs) < n {
		f, ok := nextEvent(t, frames)
		if !ok {
			t.Fatalf("stream ended after %d events, want %d", len(evs), n)
		}
		var ev contracts.OpsEvent
		if err := json.Unmarshal([]byte(f.Data), &ev); err != nil || ev.Type != f.Event {
			t.Fatalf("event %s %q: %v", f.Event, f.Data, err)
		}
		evs, ids = append(evs, ev), append(ids, f.ID)
	}
	return evs, ids
}

// TestOpsEventsStreamsWhatOperatorsWatch: an alert, a scale decision, a
// machine event and a job's migration, each with its links; Last-Event-ID
// resumes after an event; only a platform admin may read the stream.
func TestOpsEventsStreamsWhatOperatorsWatch(t *testing.T) {
	h := startGateway(t, nil, nil)
	now := time.Now().UTC()
	h.publishOps(contracts.SubjectAlert("gpu_hot"), "alert/1", contracts.Alert{SchemaVersion: contracts.SchemaVersion, Kind: "gpu_hot",
		Key: "sim-1/GPU-3", State: contracts.AlertFiring, Severity: "warning", Labels: map[string]string{"node": "sim-1", "pool": "h100"},
		Value: 91, Message: "GPU-3 at 91°C", Since: now, Time: now})
	h.publishOps(contracts.SubjectScale("h100"), "scale/1", contracts.ScaleDecision{SchemaVersion: contracts.SchemaVersion, ID: "d1",
		Pool: "h100", Direction: "up", CurrentNodes: 2, DesiredNodes: 3, Reason: "4 GPUs pending", Time: now.Add(time.Millisecond)})

	frames, stop := h.openStream("/v1/ops/events")
	evs, ids := opsEvents(t, frames, 2)
	if evs[0].Type != contracts.OpsAlert || evs[0].Alert == nil || evs[0].Alert.Kind != "gpu_hot" || evs[0].Pool != "h100" ||
		len(evs[0].Nodes) != 1 || evs[0].Nodes[0] != "sim-1" || !strings.Contains(evs[0].Summary, "firing") {
		t.Fatalf("first event %+v, want the alert linked to sim-1", evs[0])
	}
	if evs[1].Type != contracts.OpsScale || evs[1].Scale == nil || evs[1].Scale.DesiredNodes != 3 || evs[1].Pool != "h100" {
		t.Fatalf("second event %+v, want the scale decision", evs[1])
	}

	// Live: a machine event, and a job migrating off sim-1.
	h.publishMachine(contracts.MachineEvent{Kind: contracts.MachineInterrupted, Pool: "h100", MachineID: "m-1", NodeID: "sim-1",
		Message: "spot notice", Time: time.Now().UTC()})
	h.place("acme", "j1", "sim-1", 0)
	from := contracts.Placement{AllocationID: contracts.AllocationID("acme", "j1", 1), NodeID: "sim-1", Pool: "h100",
		Devices: []contracts.DeviceRef{{Index: 0, UUID: "GPU-sim-1-0", Model: "H100-80GB"}}}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventMigrating, State: contracts.StateRunning, Tenant: "acme", JobID: "j1", Attempt: 1,
		Time: time.Now().UTC(), Migration: &contracts.Migration{Reason: "spot_interruption", FromAttempt: 1, From: []contracts.Placement{from}}})
	live, liveIDs := opsEvents(t, frames, 2)
	var machine, migration *contracts.OpsEvent
	for i := range live {
		switch live[i].Type {
		case contracts.OpsMachine:
			machine = &live[i]
		case contracts.OpsMigration:
			migration = &live[i]
		}
	}
	if machine == nil || machine.Machine.Kind != contracts.MachineInterrupted || len(machine.Nodes) != 1 || machine.Nodes[0] != "sim-1" {
		t.Fatalf("live events %+v: want the machine event linked to sim-1", live)
	}
	if migration == nil || migration.Job == nil || len(migration.Jobs) != 1 || migration.Jobs[0] != (contracts.JobRef{Tenant: "acme", JobID: "j1"}) ||
		len(migration.Nodes) != 1 || migration.Nodes[0] != "sim-1" || !strings.Contains(migration.Summary, "spot_interruption") {
		t.Fatalf("live events %+v: want the migration linked to acme/j1 and sim-1", live)
	}
	stop()

	// Resume after the first event: the three after it, not the first.
	frames, stop = h.openStream("/v1/ops/events", "Last-Event-ID", ids[0])
	again, againIDs := opsEvents(t, frames, 3)
	if again[0].Type != contracts.OpsScale || againIDs[0] != ids[1] || againIDs[2] != liveIDs[1] {
		t.Fatalf("resumed after %s: %v (ids %v), want the scale decision then the live events %v", ids[0], again, againIDs, liveIDs)
	}
	stop()

	member := h.issue("acme-member", contracts.Binding{Role: RoleMember, Tenant: "acme"})
	if s, ae := h.as(member, http.MethodGet, "/v1/ops/events", "", nil); s != http.StatusForbidden || ae.Reason != contracts.ReasonForbidden {
		t.Fatalf("a tenant's member: %d %+v, want 403", s, ae)
	}
}

// gatedWriter is a client that reads nothing until gate is closed.
type gatedWriter struct {
	header http.Header
	gate   chan struct{}
	mu     sync.Mutex
	buf    strings.Builder
}

func (w *gatedWriter) Header() http.Header { return w.header }
func (w *gatedWriter) WriteHeader(int)     {}
func (w *gatedWriter) Flush()              {}
func (w *gatedWriter) Write(b []byte) (int, error) {
	<-w.gate
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(b)
}

// TestOpsStreamDropsASlowReader: a reader that takes nothing while more
// than its buffer's worth of events arrive gets what its buffer held,
// then a last dropped event naming the id to resume from; the hub holds
// nothing more for it.
func TestOpsStreamDropsASlowReader(t *testing.T) {
	ops := newOpsHub()
	s := &server{cfg: Config{Heartbeat: time.Hour}, ready: func() bool { return true }, opsReady: func() bool { return true },
		ops: ops, streams: context.Background(), log: slog.New(slog.NewTextHandler(io.Discard, nil)), now: time.Now}
	w := &gatedWriter{header: http.Header{}, gate: make(chan struct{})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.opsEvents(w, httptest.NewRequest(http.MethodGet, "/v1/ops/events", nil))
	}()
	// The handler is blocked on its first write: everything added now
	// waits in its buffer, and past the buffer it is dropped.
	deadline := time.Now().Add(waitFor)
	for {
		ops.mu.Lock()
		n := len(ops.subs)
		ops.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the stream never subscribed")
		}
		time.Sleep(time.Millisecond)
	}
	base := time.Now()
	for i := range opsSubBuffer + 10 {
		ops.add(base.Add(time.Duration(i)*time.Microsecond), contracts.OpsEvent{Type: contracts.OpsAlert, Summary: fmt.Sprint(i), Time: base})
	}
	ops.mu.Lock()
	left := len(ops.subs)
	ops.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d subscribers left after the reader fell behind, want 0", left)
	}
	close(w.gate)
	select {
	case <-done:
	case <-time.After(waitFor):
		t.Fatal("the dropped stream did not end")
	}
	out := w.buf.String()
	if got := strings.Count(out, "event: alert\n"); got != opsSubBuffer {
		t.Fatalf("%d alerts delivered, want the %d its buffer held", got, opsSubBuffer)
	}
	lastID := fmt.Sprint(base.Add(time.Duration(opsSubBuffer-1) * time.Microsecond).UnixMicro())
	if !strings.Contains(out, "event: dropped\nid: "+lastID+"\n") {
		t.Fatalf("no dropped event with id %s at the end of %q", lastID, out[max(0, len(out)-400):])
	}
}
