package resourcemanager_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// BenchmarkHeartbeatFeed measures how many heartbeats per second one
// resource manager's heartbeat feed applies (issue 17: 10,000 machines
// heartbeating every 2 s are 5,000 a second). It registers
// GPUPLANE_HB_NODES nodes (10,000 by default), then publishes
// GPUPLANE_HB_PER_NODE heartbeats per node (5) round the fleet as fast as
// the connection takes them, each as an agent sends it (its incarnation
// and 8 running allocations), and then one heartbeat of a node declared
// lost beforehand. The feed applies heartbeats in stream order, so the
// lost node's "returned" event is published only once every heartbeat
// before it was applied: the time from the first publish to that event
// is the feed's. It reports hb/s (applied) and pub-hb/s (stored; the feed
// is the limit when hb/s is well below it), and register-s: the time from
// the first inventory published to every node's registered event.
//
//	go test -run '^$' -bench HeartbeatFeed -benchtime 3x ./services/resource-manager/
func BenchmarkHeartbeatFeed(b *testing.B) {
	nodes := envCount(b, "GPUPLANE_HB_NODES", 10000)
	perNode := envCount(b, "GPUPLANE_HB_PER_NODE", 5)
	h := newHarness(b)
	cfg := h.config("rm-a")
	// The production check interval: the harness's 10 ms would measure
	// the liveness loop's scans of a large fleet as much as the feed.
	cfg.LivenessInterval = 500 * time.Millisecond
	h.start(cfg)
	began := time.Now()
	for n := range nodes {
		h.inventory(fmt.Sprintf("n%05d", n), "i1", 8, h100)
	}
	h.eventuallyWithin("all registered", 5*time.Minute, func() bool { return len(h.nodeEvents) >= nodes })
	registered := time.Since(began)
	runs := make([]string, 8)
	for i := range runs {
		runs[i] = contracts.AllocationID("acme", fmt.Sprintf("job-%06d", i), 1)
	}
	ctx := context.Background()
	var hbs, pubs float64
	round := 0
	for b.Loop() {
		round++
		// A fresh lost node each round: its heartbeat is the marker.
		sentinel := fmt.Sprintf("sentinel-%d", round)
		h.inventory(sentinel, "i1", 8, h100)
		h.eventuallyWithin("sentinel registered", time.Minute, func() bool {
			return h.hasNodeEvent(sentinel, contracts.NodeRegistered, "i1")
		})
		h.publish(contracts.SubjectNodeLifecycle(sentinel), "bench-lost/"+sentinel, contracts.NodeEvent{
			SchemaVersion: contracts.SchemaVersion, Kind: contracts.NodeLost, NodeID: sentinel, Pool: "default",
			Incarnation: "i1", Reason: "benchmark marker", Time: h.clock.Now()})
		h.eventuallyWithin("sentinel lost", time.Minute, func() bool {
			return h.hasNodeEvent(sentinel, contracts.NodeLost, "i1")
		})
		// The manager follows NODES on its own: give it time to apply the
		// loss before the marker can overtake it (setup, not measured).
		time.Sleep(500 * time.Millisecond)

		start := time.Now()
		pending := make([]*bus.Pending, 0, 4096)
		settle := func() {
			for _, p := range pending {
				if _, err := p.Wait(ctx); err != nil {
					b.Fatalf("heartbeat: %v", err)
				}
			}
			pending = pending[:0]
		}
		for k := range perNode {
			for n := range nodes {
				node := fmt.Sprintf("n%05d", n)
				seq := hbSeq.Add(1)
				p, err := h.bus.PublishAsync(ctx, contracts.SubjectHeartbeat(node), fmt.Sprintf("hb/%s/i1/%d", node, seq),
					contracts.Heartbeat{SchemaVersion: 1, NodeID: node, Incarnation: "i1", Seq: uint64(k), Time: h.clock.Now(), Runs: runs})
				if err != nil {
					b.Fatalf("heartbeat: %v", err)
				}
				if pending = append(pending, p); len(pending) == cap(pending) {
					settle()
				}
			}
		}
		settle()
		stored := time.Since(start)
		h.heartbeat(sentinel, "i1")
		h.eventuallyWithin("the marker's returned event", 5*time.Minute, func() bool {
			return h.hasNodeEvent(sentinel, contracts.NodeReturned, "i1")
		})
		fed := time.Since(start)
		total := float64(nodes * perNode)
		hbs += total / fed.Seconds()
		pubs += total / stored.Seconds()
	}
	b.ReportMetric(registered.Seconds(), "register-s")
	b.ReportMetric(hbs/float64(round), "hb/s")
	b.ReportMetric(pubs/float64(round), "pub-hb/s")
}

// envCount reads a positive count from the environment, def when unset.
func envCount(b *testing.B, name string, def int) int {
	b.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive count", name, v)
	}
	return n
}

// eventuallyWithin waits for cond, bounded by limit (eventually's 15 s is
// too short for a large fleet's registration on a loaded machine).
func (h *harness) eventuallyWithin(what string, limit time.Duration, cond func() bool) {
	h.t.Helper()
	for deadline := time.Now().Add(limit); ; time.Sleep(5 * time.Millisecond) {
		h.mu.Lock()
		ok := cond()
		h.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("timed out waiting for %s", what)
		}
	}
}
