package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// reactionFleet has a fresh GPU for every trigger of a run (an XID leaves
// its GPU held) and a fresh machine for every drain.
const reactionFleet = `
machineTypes:
  hgx-h100-8: {gpuModel: H100-80GB, gpuCount: 8, nvlink: true}
pools:
  - {name: react, machineType: hgx-h100-8, count: 60, zone: zone-a, priceClass: spot}
`

// BenchmarkReaction measures how fast the platform reacts, with no
// operator, on the embedded stack: from the triggering fact to the
// scheduler's decision (the migrating event) and to the restored run (the
// migrated event: the next attempt runs on new devices from the
// checkpoint). Two triggers: an XID fault injected into the GPU a
// checkpointable job runs on (agent health → inventory → scheduler), an
// overheating fault (from the first telemetry sample above 85 °C: monitor
// rule gpu_hot → drain_gpu alert → scheduler's GPU hold in KV →
// scheduler), and a spot interruption
// hold written on its machine, as the autoscaler writes it on a provider's
// notice (KV → scheduler). The restored time includes
// the job's checkpoint (the simulated job writes it at once), the stop, the
// release, the new placement and the start.
//
//	make bench   (or: go test -run '^$' -bench Reaction -benchtime 1x ./e2e/)
func BenchmarkReaction(b *testing.B) {
	const moves = 25
	fl, err := fleet.Parse([]byte(reactionFleet))
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		s := startStack(b, &fl, withScheduler(0, 2*time.Second))
		// Generous: every move is waited for in turn, and a shared machine
		// can stall the file-backed stream for seconds at a time.
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		waitNodes(b, ctx, s, len(fl.Machines()))
		r := newReactions(b, s)
		b.StartTimer()
		for k := range moves {
			r.move(b, ctx, fmt.Sprintf("x%d-%d", i, k), "xid")
		}
		for k := range moves {
			r.move(b, ctx, fmt.Sprintf("h%d-%d", i, k), "overheat")
		}
		for k := range moves {
			r.move(b, ctx, fmt.Sprintf("s%d-%d", i, k), "spot")
		}
		b.StopTimer()
		cancel()
		for _, trig := range []string{"xid", "overheat", "spot"} {
			dec, res := r.stats(trig)
			b.ReportMetric(ms(pct(dec, 50)), trig+"-decision-p50-ms")
			b.ReportMetric(ms(pct(dec, 99)), trig+"-decision-p99-ms")
			b.ReportMetric(ms(pct(res, 50)), trig+"-restored-p50-ms")
			b.ReportMetric(ms(pct(res, 99)), trig+"-restored-p99-ms")
			b.Logf("%s: %d moves; trigger→decision p50 %s p99 %s; trigger→restored run p50 %s p99 %s",
				trig, len(dec), pct(dec, 50).Round(100*time.Microsecond), pct(dec, 99).Round(100*time.Microsecond),
				pct(res, 50).Round(time.Millisecond), pct(res, 99).Round(time.Millisecond))
			b.Logf("%s: slowest %s", trig, r.slowest(trig))
		}
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (len(s)*p + 99) / 100
	return s[min(max(i-1, 0), len(s)-1)]
}

// reactions watches the bench tenant's events as JetStream stores them.
type reactions struct {
	s       *stack
	mu      sync.Mutex
	seen    map[string]map[contracts.JobEventType]time.Time // job → type → first seen
	evs     map[string]contracts.JobEvent                   // job → last running event
	results map[string][][2]time.Duration
	t0s     map[string]time.Time // job → trigger time
	gpuOf   map[string]string    // job → its first GPU
	alertAt map[string]time.Time // GPU → first firing alert with an action seen
	holdAt  map[string]time.Time // GPU → first hold of it seen in gp-node-admin
}

func newReactions(b *testing.B, s *stack) *reactions {
	r := &reactions{s: s, seen: map[string]map[contracts.JobEventType]time.Time{}, evs: map[string]contracts.JobEvent{},
		results: map[string][][2]time.Duration{}, t0s: map[string]time.Time{},
		gpuOf: map[string]string{}, alertAt: map[string]time.Time{}, holdAt: map[string]time.Time{}}
	// The overheating chain's hops: the monitor's alert on the bus, the
	// scheduler's hold in the bucket.
	asub, err := s.nc.Subscribe(contracts.SubjectAlertsAll, func(m *nats.Msg) {
		now := time.Now()
		var a contracts.Alert
		if json.Unmarshal(m.Data, &a) != nil || a.State != contracts.AlertFiring || a.Labels[contracts.AlertLabelAction] == "" {
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if g := a.Labels[contracts.AlertLabelGPU]; g != "" {
			if _, ok := r.alertAt[g]; !ok {
				r.alertAt[g] = now
			}
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = asub.Unsubscribe() })
	kv, err := s.js.KeyValue(context.Background(), contracts.BucketNodeAdmin)
	if err != nil {
		b.Fatal(err)
	}
	w, err := kv.WatchAll(context.Background())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = w.Stop() })
	go func() {
		for e := range w.Updates() {
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue
			}
			now := time.Now()
			var h contracts.NodeAdmin
			if json.Unmarshal(e.Value(), &h) != nil {
				continue
			}
			r.mu.Lock()
			for g := range h.GPUs {
				if _, ok := r.holdAt[g]; !ok {
					r.holdAt[g] = now
				}
			}
			r.mu.Unlock()
		}
	}()
	sub, err := s.nc.Subscribe(contracts.SubjectTenantJobEvents("bench"), func(m *nats.Msg) {
		now := time.Now()
		var ev contracts.JobEvent
		if json.Unmarshal(m.Data, &ev) != nil {
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.seen[ev.JobID] == nil {
			r.seen[ev.JobID] = map[contracts.JobEventType]time.Time{}
		}
		if _, ok := r.seen[ev.JobID][ev.Type]; !ok {
			r.seen[ev.JobID][ev.Type] = now
		}
		if ev.Attempt > 1 {
			// The next attempt's steps, for slowest.
			if _, ok := r.seen[ev.JobID][ev.Type+"#2"]; !ok {
				r.seen[ev.JobID][ev.Type+"#2"] = now
			}
		}
		if ev.Type == contracts.EventRunning {
			r.evs[ev.JobID] = ev
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = sub.Unsubscribe() })
	return r
}

func (r *reactions) await(b *testing.B, ctx context.Context, id string, typ contracts.JobEventType) time.Time {
	b.Helper()
	for {
		r.mu.Lock()
		t, ok := r.seen[id][typ]
		r.mu.Unlock()
		if ok {
			return t
		}
		select {
		case <-ctx.Done():
			b.Fatalf("%s: no %s event: %v", id, typ, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
}

// move runs one checkpointable job, triggers its move and records the
// reaction times; the job is cancelled afterwards to free its GPU.
func (r *reactions) move(b *testing.B, ctx context.Context, id, trigger string) {
	b.Helper()
	req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
		Run: contracts.RunSpec{Duration: contracts.Duration(10 * time.Minute), Checkpoint: true}}
	body, _ := json.Marshal(req)
	if _, err := r.s.submitBus(ctx, "bench", contracts.SubmitMsgID("bench", id), body); err != nil {
		b.Fatal(err)
	}
	r.await(b, ctx, id, contracts.EventRunning)
	r.mu.Lock()
	run := r.evs[id]
	r.mu.Unlock()
	node, gpu := run.Placement.NodeID, run.Placement.Devices[0].UUID
	var t0 time.Time
	switch trigger {
	case "xid", "overheat":
		f := contracts.Fault{ID: "xid-" + id, Kind: contracts.FaultXID, GPU: gpu, Code: contracts.DefaultFaultXID}
		var hot chan time.Time
		if trigger == "overheat" {
			f = contracts.Fault{ID: "hot-" + id, Kind: contracts.FaultOverheat, GPU: gpu}
			hot = r.firstHotSample(b, node, gpu)
		}
		cmd := contracts.NodeCommand{SchemaVersion: 1, Kind: contracts.CommandInjectFault, Fault: &f, Time: time.Now().UTC()}
		data, _ := json.Marshal(cmd)
		t0 = time.Now()
		if _, err := r.s.js.Publish(ctx, contracts.SubjectNodeCommands(node), data,
			jetstream.WithMsgID(contracts.FaultCommandID(node, f.ID))); err != nil {
			b.Fatal(err)
		}
		if hot != nil {
			// The triggering event of an overheat is the first telemetry
			// sample above the rule's 85 °C: the fault heats the die at
			// once, the agent samples every second.
			select {
			case t0 = <-hot:
			case <-ctx.Done():
				b.Fatalf("%s: no hot sample", id)
			}
		}
	case "spot":
		kv, err := r.s.js.KeyValue(ctx, contracts.BucketNodeAdmin)
		if err != nil {
			b.Fatal(err)
		}
		deadline := time.Now().Add(2 * time.Minute).UTC()
		data, _ := json.Marshal(contracts.NodeAdmin{SchemaVersion: 1, NodeID: node, Cordoned: true, Drain: true,
			Cause: contracts.ReasonSpotInterruption, Deadline: &deadline, Reason: "bench notice", Time: time.Now().UTC()})
		t0 = time.Now()
		if _, err := kv.Put(ctx, node, data); err != nil {
			b.Fatal(err)
		}
	}
	decided := r.await(b, ctx, id, contracts.EventMigrating)
	restored := r.await(b, ctx, id, contracts.EventMigrated)
	r.mu.Lock()
	r.results[trigger] = append(r.results[trigger], [2]time.Duration{decided.Sub(t0), restored.Sub(t0)})
	r.t0s[id] = t0
	r.gpuOf[id] = gpu
	r.mu.Unlock()
	cancelBody, _ := json.Marshal(contracts.CancelRequest{JobID: id})
	if _, err := r.s.js.Publish(ctx, contracts.SubjectCancel("bench"), cancelBody,
		jetstream.WithMsgID(contracts.CancelMsgID("bench", id))); err != nil {
		b.Fatal(err)
	}
	r.await(b, ctx, id, contracts.EventCancelled)
}

// firstHotSample reports when the first telemetry sample of gpu above
// 85 °C reaches the bus.
func (r *reactions) firstHotSample(b *testing.B, node, gpu string) chan time.Time {
	out := make(chan time.Time, 1)
	var once sync.Once
	var sub *nats.Subscription
	sub, err := r.s.nc.Subscribe(contracts.SubjectTelemetry(node), func(m *nats.Msg) {
		now := time.Now()
		var tm contracts.Telemetry
		if json.Unmarshal(m.Data, &tm) != nil {
			return
		}
		for _, g := range tm.GPUs {
			if g.UUID == gpu && g.TempC > 85 {
				once.Do(func() {
					out <- now
					go func() { _ = sub.Unsubscribe() }()
				})
			}
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	return out
}

// slowest describes the move of trigger that took longest to restore:
// when each of its events was seen, from the trigger.
func (r *reactions) slowest(trigger string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var worst string
	var most time.Duration
	prefix := map[string]byte{"xid": 'x', "overheat": 'h', "spot": 's'}[trigger]
	for id, t0 := range r.t0s {
		if id[0] != prefix {
			continue
		}
		if d := r.seen[id][contracts.EventMigrated].Sub(t0); d > most {
			worst, most = id, d
		}
	}
	if worst == "" {
		return ""
	}
	out := worst + ":"
	if at, ok := r.alertAt[r.gpuOf[worst]]; ok {
		out += fmt.Sprintf(" alert +%s", at.Sub(r.t0s[worst]).Round(100*time.Microsecond))
	}
	if at, ok := r.holdAt[r.gpuOf[worst]]; ok {
		out += fmt.Sprintf(" hold +%s", at.Sub(r.t0s[worst]).Round(100*time.Microsecond))
	}
	for _, typ := range []contracts.JobEventType{contracts.EventMigrating, contracts.EventRequeued, contracts.EventScheduled + "#2",
		contracts.EventRunning + "#2", contracts.EventMigrated} {
		if at, ok := r.seen[worst][typ]; ok {
			out += fmt.Sprintf(" %s +%s", typ, at.Sub(r.t0s[worst]).Round(100*time.Microsecond))
		}
	}
	return out
}

func (r *reactions) stats(trigger string) (decision, restored []time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, x := range r.results[trigger] {
		decision = append(decision, x[0])
		restored = append(restored, x[1])
	}
	return decision, restored
}
