package gateway

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// place runs a job of tenant on node's GPUs (by index), as the
// scheduler's events say: queued, scheduled with its placement, running.
func (h *harness) place(tenant, job, node string, gpus ...int) {
	h.t.Helper()
	at := time.Now().UTC()
	h.publishEvent(queued(tenant, job, at))
	p := &contracts.Placement{AllocationID: contracts.AllocationID(tenant, job, 1), NodeID: node, Pool: "h100"}
	for _, i := range gpus {
		p.Devices = append(p.Devices, contracts.DeviceRef{Index: i, UUID: "GPU-" + node + "-" + strconv.Itoa(i), Model: "H100-80GB"})
	}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: tenant, JobID: job, Attempt: 1, Time: at, Placement: p})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, Tenant: tenant, JobID: job, Attempt: 1, Time: at, StartedAt: &at})
}

// fleetEvent reads events until one satisfies match and returns it with
// its id; it fails the test at the end of the stream or after waitFor.
func fleetEvent(t *testing.T, frames <-chan sseFrame, what string, match func(contracts.FleetEvent) bool) (contracts.FleetEvent, string) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for time.Now().Before(deadline) {
		f, ok := nextEvent(t, frames)
		if !ok {
			t.Fatalf("stream ended waiting for %s", what)
		}
		var ev contracts.FleetEvent
		if err := json.Unmarshal([]byte(f.Data), &ev); err != nil {
			t.Fatalf("event %q: %v", f.Data, err)
		}
		if ev.Type != f.Event {
			t.Fatalf("event named %q carries type %q", f.Event, ev.Type)
		}
		if match(ev) {
			return ev, f.ID
		}
	}
	t.Fatalf("no event %s within %s", what, waitFor)
	return contracts.FleetEvent{}, ""
}

func nodeOf(nodes []contracts.FleetNode, id string) *contracts.FleetNode {
	i := slices.IndexFunc(nodes, func(n contracts.FleetNode) bool { return n.NodeID == id })
	if i < 0 {
		return nil
	}
	return &nodes[i]
}

func (h *harness) publishHealth(ev contracts.HealthEvent) {
	h.t.Helper()
	ev.SchemaVersion = contracts.SchemaVersion
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectNodeHealth(ev.NodeID), contracts.HealthEventID(ev.NodeID, ev.Incarnation, ev.Seq), ev); err != nil {
		h.t.Fatalf("publish health: %v", err)
	}
}

func (h *harness) publishMachine(ev contracts.MachineEvent) {
	h.t.Helper()
	ev.SchemaVersion = contracts.SchemaVersion
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectMachines(ev.Pool), contracts.MachineEventID(ev.Kind, ev.MachineID), ev); err != nil {
		h.t.Fatalf("publish machine event: %v", err)
	}
}

// TestFleetEventsSnapshotThenDeltas: the first event is every node with
// its GPUs' owners; then each change (a GPU's health, a cordon, a job's
// end, a machine taken away) comes as the node it changed, as it now is.
func TestFleetEventsSnapshotThenDeltas(t *testing.T) {
	h := startGateway(t, nil, func(h *harness) {
		h.publishInventory(inventory("sim-1", "sim"), 1)
		h.publishInventory(inventory("sim-2", "sim"), 1)
	})
	h.waitNode("sim-2")
	h.place("acme", "j1", "sim-1", 0, 1)
	h.waitState("j1", contracts.StateRunning, 1)

	frames, _ := h.openStream("/v1/fleet/events")
	snap, _ := fleetEvent(t, frames, "snapshot", func(ev contracts.FleetEvent) bool { return true })
	if snap.Type != contracts.FleetSnapshot || len(snap.Nodes) != 2 || snap.Redacted {
		t.Fatalf("first event %s with %d nodes (redacted %v), want a snapshot of 2", snap.Type, len(snap.Nodes), snap.Redacted)
	}
	n1 := nodeOf(snap.Nodes, "sim-1")
	want := contracts.GPUOwner{Tenant: "acme", JobID: "j1", AllocationID: contracts.AllocationID("acme", "j1", 1), MilliGPUs: 1000}
	if n1 == nil || len(n1.GPUs) != 8 || len(n1.GPUs[0].Owners) != 1 || n1.GPUs[0].Owners[0] != want ||
		len(n1.GPUs[2].Owners) != 0 || n1.AllocatedMilliGPUs != 2000 || n1.Pool != "h100" {
		t.Fatalf("sim-1 in the snapshot: %+v", n1)
	}

	// A GPU falls off the bus: its node comes again with the fact.
	h.publishHealth(contracts.HealthEvent{NodeID: "sim-2", Incarnation: "inc-1", Seq: 1, GPUUUID: "GPU-sim-2-3", GPUIndex: 3,
		Kind: contracts.HealthXID, Code: 79, Healthy: false, Message: "fell off the bus", Time: time.Now().UTC()})
	ev, _ := fleetEvent(t, frames, "sim-2's XID", func(ev contracts.FleetEvent) bool {
		return ev.Type == contracts.FleetNodeChanged && ev.NodeID == "sim-2" && ev.Node != nil && ev.Node.GPUs[3].Health != nil
	})
	if hv := ev.Node.GPUs[3].Health; hv.Kind != contracts.HealthXID || hv.Code != 79 || hv.Healthy {
		t.Fatalf("sim-2 GPU 3 health %+v", hv)
	}

	// A cordon.
	if status, body := h.do(http.MethodPost, "/v1/nodes/sim-1/cordon", `{"reason":"maintenance"}`, nil); status != http.StatusOK {
		t.Fatalf("cordon: %d %s", status, body)
	}
	ev, _ = fleetEvent(t, frames, "sim-1's cordon", func(ev contracts.FleetEvent) bool {
		return ev.NodeID == "sim-1" && ev.Node != nil && ev.Node.Admin != nil
	})
	if !ev.Node.Admin.Cordoned || ev.Node.Admin.Reason != "maintenance" || len(ev.Node.GPUs[0].Owners) != 1 {
		t.Fatalf("sim-1 after its cordon: %+v", ev.Node)
	}

	// The job ends: its GPUs are free.
	end := time.Now().UTC()
	h.publishEvent(contracts.JobEvent{Type: contracts.EventSucceeded, State: contracts.StateSucceeded, Tenant: "acme", JobID: "j1",
		Attempt: 1, Time: end, EndedAt: &end})
	ev, _ = fleetEvent(t, frames, "sim-1 free", func(ev contracts.FleetEvent) bool {
		return ev.NodeID == "sim-1" && ev.Node != nil && ev.Node.AllocatedMilliGPUs == 0
	})
	if len(ev.Node.GPUs[0].Owners) != 0 {
		t.Fatalf("sim-1's GPU 0 still owned after the job ended: %+v", ev.Node.GPUs[0])
	}

	// The autoscaler deletes sim-2's machine: the node is removed.
	h.publishMachine(contracts.MachineEvent{Kind: contracts.MachineDeleted, Pool: "h100", MachineID: "m-2", NodeID: "sim-2",
		Time: time.Now().UTC().Add(time.Second)})
	ev, _ = fleetEvent(t, frames, "sim-2 removed", func(ev contracts.FleetEvent) bool { return ev.NodeID == "sim-2" && ev.Removed })
	if ev.Node != nil {
		t.Fatalf("a removed node carries %+v", ev.Node)
	}
}

// TestFleetEventsResume: Last-Event-ID resumes with the nodes changed
// since (not a snapshot); an id this gateway cannot answer from gets a
// snapshot, and one that is no number is refused.
func TestFleetEventsResume(t *testing.T) {
	h := startGateway(t, nil, func(h *harness) {
		h.publishInventory(inventory("sim-1", "sim"), 1)
		h.publishInventory(inventory("sim-2", "sim"), 1)
	})
	h.waitNode("sim-2")
	frames, stop := h.openStream("/v1/fleet/events")
	_, id := fleetEvent(t, frames, "snapshot", func(ev contracts.FleetEvent) bool { return ev.Type == contracts.FleetSnapshot })
	stop()

	// While the client is away, sim-1 gets a job. The resume sends the
	// nodes changed since the id (less a margin, so sim-2 may come
	// again too): never a snapshot, and sim-1 as it now is.
	h.place("acme", "j1", "sim-1", 4)
	h.waitState("j1", contracts.StateRunning, 1)
	frames, stop = h.openStream("/v1/fleet/events", "Last-Event-ID", id)
	first := true
	fleetEvent(t, frames, "sim-1's change", func(ev contracts.FleetEvent) bool {
		if first && ev.Type != contracts.FleetNodeChanged {
			t.Fatalf("first event after resume is a %s, want node events", ev.Type)
		}
		first = false
		return ev.NodeID == "sim-1" && ev.Node != nil && len(ev.Node.GPUs[4].Owners) == 1
	})
	stop()

	for _, old := range []string{"1", "99999999999999999"} {
		frames, stop = h.openStream("/v1/fleet/events?lastEventId=" + old)
		ev, _ := fleetEvent(t, frames, "snapshot", func(ev contracts.FleetEvent) bool { return true })
		if ev.Type != contracts.FleetSnapshot || len(ev.Nodes) != 2 {
			t.Fatalf("Last-Event-ID %s: first event %s with %d nodes, want a snapshot of 2", old, ev.Type, len(ev.Nodes))
		}
		stop()
	}
	var ae contracts.APIError
	if status, _ := h.do(http.MethodGet, "/v1/fleet/events", "", &ae, "Last-Event-ID", "yesterday"); status != http.StatusBadRequest ||
		ae.Error.Reason != contracts.ReasonInvalidValue {
		t.Fatalf("Last-Event-ID yesterday: %d %+v", status, ae)
	}
}

// TestFleetEventsHideOtherTenantsWork: a tenant's caller sees the fleet
// with its own jobs' owners and other tenants' as hidden; a platform
// admin sees both; a caller without roles is refused.
func TestFleetEventsHideOtherTenantsWork(t *testing.T) {
	h := startGateway(t, nil, func(h *harness) { h.publishInventory(inventory("sim-1", "sim"), 1) })
	h.waitNode("sim-1")
	h.place("acme", "mine", "sim-1", 0)
	h.place("globex", "theirs", "sim-1", 1)
	h.eventually("both jobs run", func() bool {
		var st contracts.JobStatus
		s, _ := h.do(http.MethodGet, "/v1/tenants/globex/jobs/theirs", "", &st)
		return s == 200 && st.State == contracts.StateRunning
	})
	h.waitState("mine", contracts.StateRunning, 1)
	viewer := h.issue("acme-viewer", contracts.Binding{Role: RoleViewer, Tenant: "acme"})
	nobody := h.issue("nobody")

	owners := func(token string) (contracts.FleetEvent, []contracts.GPUOwner) {
		t.Helper()
		var headers []string
		if token != "" {
			headers = []string{"Authorization", "Bearer " + token}
		}
		frames, stop := h.openStream("/v1/fleet/events", headers...)
		defer stop()
		ev, _ := fleetEvent(t, frames, "a snapshot with both jobs", func(ev contracts.FleetEvent) bool {
			n := nodeOf(ev.Nodes, "sim-1")
			return ev.Type == contracts.FleetSnapshot && n != nil && len(n.GPUs[0].Owners) == 1 && len(n.GPUs[1].Owners) == 1
		})
		n := nodeOf(ev.Nodes, "sim-1")
		return ev, []contracts.GPUOwner{n.GPUs[0].Owners[0], n.GPUs[1].Owners[0]}
	}
	ev, got := owners(viewer)
	if !ev.Redacted || got[0].Tenant != "acme" || got[0].JobID != "mine" || got[0].Hidden ||
		got[1] != (contracts.GPUOwner{Hidden: true, MilliGPUs: 1000}) {
		t.Fatalf("acme's viewer sees owners %+v (redacted %v), want its own and a hidden one", got, ev.Redacted)
	}
	ev, got = owners("")
	if ev.Redacted || got[1].Tenant != "globex" || got[1].JobID != "theirs" || got[1].Hidden {
		t.Fatalf("the platform admin sees owners %+v (redacted %v)", got, ev.Redacted)
	}
	if s, ae := h.as(nobody, http.MethodGet, "/v1/fleet/events", "", nil); s != http.StatusForbidden || ae.Reason != contracts.ReasonForbidden {
		t.Fatalf("a caller without roles: %d %+v, want 403", s, ae)
	}
}

// TestFleetEventsGzip: a client that takes gzip gets the stream
// compressed (a snapshot is megabytes of JSON), flushed per batch so the
// first event arrives whole; one that does not gets it plain.
func TestFleetEventsGzip(t *testing.T) {
	h := startGateway(t, nil, func(h *harness) { h.publishInventory(inventory("sim-1", "sim"), 1) })
	h.waitNode("sim-1")
	raw := &http.Client{Transport: bearer{token: h.token, base: &http.Transport{DisableCompression: true}}}
	for _, enc := range []string{"gzip", "identity"} {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, h.url+"/v1/fleet/events", nil)
		req.Header.Set("Accept-Encoding", enc)
		res, err := raw.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body io.Reader = res.Body
		if enc == "gzip" {
			if res.Header.Get("Content-Encoding") != "gzip" {
				t.Fatalf("Accept-Encoding gzip: Content-Encoding %q", res.Header.Get("Content-Encoding"))
			}
			zr, err := gzip.NewReader(res.Body)
			if err != nil {
				t.Fatalf("gzip stream: %v", err)
			}
			body = zr
		} else if ce := res.Header.Get("Content-Encoding"); ce != "" {
			t.Fatalf("Accept-Encoding identity: Content-Encoding %q", ce)
		}
		sc := bufio.NewScanner(body)
		sc.Buffer(nil, 1<<20)
		var snap contracts.FleetEvent
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				if err := json.Unmarshal([]byte(data), &snap); err != nil {
					t.Fatal(err)
				}
				break
			}
		}
		if snap.Type != contracts.FleetSnapshot || len(snap.Nodes) != 1 {
			t.Fatalf("%s: first event %+v (scan err %v)", enc, snap, sc.Err())
		}
		res.Body.Close()
		cancel()
	}
}

// TestFleetStreamsAreBoundedPerCaller: the fleet route names no tenant,
// so a tenant's caller's fleet streams are counted per caller (as many
// as a tenant's streams may be); a platform admin's are not.
func TestFleetStreamsAreBoundedPerCaller(t *testing.T) {
	h := startGateway(t, func(c *Config) { c.Limits.StreamsPerTenant = 1 }, func(h *harness) {
		h.publishInventory(inventory("sim-1", "sim"), 1)
	})
	h.waitNode("sim-1")
	viewer := h.issue("acme-viewer", contracts.Binding{Role: RoleViewer, Tenant: "acme"})
	frames, stop := h.openStream("/v1/fleet/events", "Authorization", "Bearer "+viewer)
	fleetEvent(t, frames, "the snapshot", func(ev contracts.FleetEvent) bool { return ev.Type == contracts.FleetSnapshot })
	if s, ae := h.as(viewer, http.MethodGet, "/v1/fleet/events", "", nil); s != http.StatusTooManyRequests || ae.Reason != contracts.ReasonTooManyStreams {
		t.Fatalf("a second stream of one caller: %d %+v, want 429 too_many_streams", s, ae)
	}
	for range 2 {
		admin, stopAdmin := h.openStream("/v1/fleet/events")
		fleetEvent(t, admin, "the admin's snapshot", func(ev contracts.FleetEvent) bool { return ev.Type == contracts.FleetSnapshot })
		defer stopAdmin()
	}
	stop()
	h.eventually("the caller's stream released", func() bool {
		s, _ := h.probe(http.MethodGet, "/v1/fleet/events", "", viewer)
		return s == http.StatusOK
	})
}

// TestIdleFleetStreamOutlivesItsWriteDeadline: the write deadline bounds
// one batch, not the stream: an idle stream keeps sending heartbeats long
// past it.
func TestIdleFleetStreamOutlivesItsWriteDeadline(t *testing.T) {
	old := fleetWriteTimeout
	fleetWriteTimeout = 100 * time.Millisecond
	t.Cleanup(func() { fleetWriteTimeout = old })
	h := startGateway(t, func(c *Config) { c.Heartbeat = 20 * time.Millisecond }, func(h *harness) {
		h.publishInventory(inventory("sim-1", "sim"), 1)
	})
	h.waitNode("sim-1")
	frames, _ := h.openStream("/v1/fleet/events")
	fleetEvent(t, frames, "the snapshot", func(ev contracts.FleetEvent) bool { return ev.Type == contracts.FleetSnapshot })
	start := time.Now()
	beats := 0
	for beats < 5 || time.Since(start) < 4*fleetWriteTimeout {
		select {
		case f, ok := <-frames:
			if !ok {
				t.Fatalf("the stream ended after %d heartbeats (%s idle)", beats, time.Since(start))
			}
			if f.Comment == "heartbeat" {
				beats++
			}
		case <-time.After(waitFor):
			t.Fatal("no heartbeat")
		}
	}
}
