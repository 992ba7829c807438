package gateway

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// BenchmarkFleetSnapshot measures the first event of GET
// /v1/fleet/events for a large fleet: 2,000 machines of 8 GPUs (each with
// a health fact on one GPU and telemetry on all), 10,000 jobs in the read
// model of which 6,000 run (one GPU each, three per machine) and 4,000
// wait. The models are filled as the ingester fills them (the same apply
// calls, without the bus); "build" is the snapshot's assembly and JSON
// encoding, "http" the whole request over loopback to the last byte of
// the snapshot event, through the real handler. It reports the event's
// bytes.
func BenchmarkFleetSnapshot(b *testing.B) {
	const machines, jobs, running = 2000, 10000, 6000
	nodes, model := newNodeModel(), newMemoryModel()
	hub := newFleetHub(nodes, model, time.Now)
	nodes.changed = hub.changed
	now := time.Now().UTC()
	for m := range machines {
		id := "node-" + strconv.Itoa(m)
		inv := inventory(id, "sim")
		nodes.applyInventory(inv, uint64(m+1))
		nodes.applyLifecycle(contracts.NodeEvent{Kind: contracts.NodeRegistered, NodeID: id, Pool: "h100", Time: now}, uint64(m+1))
		hub.applyHealth(contracts.HealthEvent{NodeID: id, GPUUUID: inv.GPUs[7].UUID, GPUIndex: 7, Kind: contracts.HealthThermal,
			Healthy: true, Message: "slowdown", Time: now})
		t := contracts.Telemetry{NodeID: id, Pool: "h100", Time: now}
		for _, g := range inv.GPUs {
			t.GPUs = append(t.GPUs, contracts.GPUSample{Index: g.Index, UUID: g.UUID, GPUUtil: 87, FBUsedMiB: 40000, TempC: 61, PowerW: 550, Healthy: true})
		}
		hub.applyTelemetry(t)
	}
	ctx := context.Background()
	var seq uint64
	apply := func(ev contracts.JobEvent) {
		seq++
		if err := model.ApplyJobEvent(ctx, ev.Tenant, ev.JobID, ev, seq); err != nil {
			b.Fatal(err)
		}
		st, _ := model.Job(ctx, ev.Tenant, ev.JobID)
		hub.observeJob(st)
	}
	for j := range jobs {
		tenant := "tenant-" + strconv.Itoa(j%20)
		id := "job-" + strconv.Itoa(j)
		apply(queued(tenant, id, now))
		if j >= running {
			continue
		}
		node := "node-" + strconv.Itoa(j%machines)
		gpu := j / machines
		p := &contracts.Placement{AllocationID: contracts.AllocationID(tenant, id, 1), NodeID: node, Pool: "h100",
			Devices: []contracts.DeviceRef{{Index: gpu, UUID: "GPU-" + node + "-" + strconv.Itoa(gpu), Model: "H100-80GB"}}}
		apply(contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: tenant, JobID: id, Attempt: 1, Time: now, Placement: p})
		apply(contracts.JobEvent{Type: contracts.EventRunning, State: contracts.StateRunning, Tenant: tenant, JobID: id, Attempt: 1, Time: now, StartedAt: &now})
	}

	b.Run("build", func(b *testing.B) {
		var data []byte
		for b.Loop() {
			var err error
			if data, err = json.Marshal(contracts.FleetEvent{Type: contracts.FleetSnapshot, Nodes: hub.snapshot(fleetView{}), Time: now}); err != nil {
				b.Fatal(err)
			}
		}
		var zipped bytes.Buffer
		gz, _ := gzip.NewWriterLevel(&zipped, gzip.BestSpeed)
		_, _ = gz.Write(data)
		_ = gz.Close()
		b.ReportMetric(float64(len(data)), "bytes")
		b.ReportMetric(float64(zipped.Len()), "gzip-bytes")
	})

	s := &server{cfg: Config{Heartbeat: time.Hour}, nodes: nodes, model: model, fleet: hub, ready: func() bool { return true },
		adminReady: func() bool { return true }, streams: context.Background(), log: slog.New(slog.DiscardHandler), now: time.Now}
	admin := Principal{Subject: "token:bench", Roles: []RoleBinding{{Role: RolePlatformAdmin}}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.fleetEvents(w, r.WithContext(withPrincipal(r.Context(), admin)))
	}))
	defer srv.Close()
	b.Run("http", func(b *testing.B) {
		var size int
		var data string
		for b.Loop() {
			size, data = readSnapshot(b, srv.URL)
		}
		// Real work: the snapshot holds every machine and its owners.
		var sample contracts.FleetEvent
		if err := json.Unmarshal([]byte(data), &sample); err != nil {
			b.Fatal(err)
		}
		owned := 0
		for _, n := range sample.Nodes {
			for _, g := range n.GPUs {
				owned += len(g.Owners)
			}
		}
		if len(sample.Nodes) != machines || owned != running {
			b.Fatalf("snapshot of %d nodes with %d owned GPUs, want %d and %d", len(sample.Nodes), owned, machines, running)
		}
		b.ReportMetric(float64(size), "bytes")
	})
}

// BenchmarkFleetSnapshotOverNATS is the same fleet published on a real
// JetStream (2,000 inventories; 10,000 jobs' queued, scheduled and
// running events), read by a real gateway from the streams at its start,
// and the snapshot asked over HTTP with a platform admin's token. It
// reports how long the gateway took to catch up (catchup-ms, once) and
// the snapshot's bytes; ns/op is one request to the snapshot's last byte.
func BenchmarkFleetSnapshotOverNATS(b *testing.B) {
	const machines, jobs, running = 2000, 10000, 6000
	srv := natstest.Start(b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bb, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench-fleet", CredsFile: natstest.Operator(b, srv)})
	if err != nil {
		b.Fatal(err)
	}
	defer bb.Close(context.Background())
	now := time.Now().UTC()
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(16)
	for m := range machines {
		g.Go(func() error {
			inv := inventory("node-"+strconv.Itoa(m), "sim")
			_, err := bb.Publish(gctx, contracts.SubjectInventory(inv.NodeID), contracts.InventoryID(inv.NodeID, inv.Incarnation, 1), inv)
			return err
		})
	}
	for j := range jobs {
		g.Go(func() error {
			tenant, id := "tenant-"+strconv.Itoa(j%20), "job-"+strconv.Itoa(j)
			evs := []contracts.JobEvent{queued(tenant, id, now)}
			if j < running {
				node, gpu := "node-"+strconv.Itoa(j%machines), j/machines
				p := &contracts.Placement{AllocationID: contracts.AllocationID(tenant, id, 1), NodeID: node, Pool: "h100",
					Devices: []contracts.DeviceRef{{Index: gpu, UUID: "GPU-" + node + "-" + strconv.Itoa(gpu), Model: "H100-80GB"}}}
				evs = append(evs,
					contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: tenant, JobID: id, Attempt: 1, Time: now, Placement: p},
					contracts.JobEvent{Type: contracts.EventRunning, State: contracts.StateRunning, Tenant: tenant, JobID: id, Attempt: 1, Time: now, StartedAt: &now})
			}
			for _, ev := range evs { // in order: one job's events are one subject
				ev.SchemaVersion = contracts.SchemaVersion
				if _, err := bb.Publish(gctx, contracts.SubjectJobEvents(tenant, id), contracts.JobEventID(tenant, id, ev.Type, 1, 0), ev); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	url, hc, catchup := benchGateway(b, ctx, srv, bb, nil, nil)
	var size int
	var data string
	for b.Loop() {
		size, data = readSnapshotWith(b, hc, url+"/v1/fleet/events")
	}
	var sample contracts.FleetEvent
	if err := json.Unmarshal([]byte(data), &sample); err != nil {
		b.Fatal(err)
	}
	owned := 0
	for _, n := range sample.Nodes {
		for _, g := range n.GPUs {
			owned += len(g.Owners)
		}
	}
	if len(sample.Nodes) != machines || owned != running {
		b.Fatalf("snapshot of %d nodes with %d owned GPUs, want %d and %d", len(sample.Nodes), owned, machines, running)
	}
	b.ReportMetric(float64(size), "bytes")
	b.ReportMetric(float64(catchup.Milliseconds()), "catchup-ms")
}

// readSnapshot reads a stream's first event and returns its size on the
// wire (up to the end of its data line) and its data.
func readSnapshot(b *testing.B, url string) (int, string) {
	return readSnapshotWith(b, http.DefaultClient, url)
}

func readSnapshotWith(b *testing.B, hc *http.Client, url string) (int, string) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	res, err := hc.Do(req)
	if err != nil {
		b.Fatal(err)
	}
	defer res.Body.Close()
	rd := bufio.NewReaderSize(res.Body, 1<<20)
	size := 0
	for {
		line, err := rd.ReadString('\n')
		size += len(line)
		if err != nil {
			b.Fatalf("stream ended before the snapshot: %v", err)
		}
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			return size, data
		}
	}
}
