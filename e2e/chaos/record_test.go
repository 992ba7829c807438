package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// stopFact is a run stopped, or a job requeued or failed, for a reason
// that blames the machine or its agent.
type stopFact struct {
	at     time.Time
	what   string // "release", "requeued", "failed"
	job    string
	alloc  string
	node   string
	reason contracts.Reason
}

// recorder keeps, from the streams, the times of every useful output the
// suite measures recovery by, and the facts the figures count. Stream
// times are the servers' (JetStream's) receive times, on the same clock
// as the suite's own on this one machine.
type recorder struct {
	mu             sync.Mutex
	scheduled      []time.Time          // every scheduled event
	firstScheduled map[string]time.Time // job -> its first scheduled event
	last           map[string]contracts.JobEvent
	committed      []time.Time // ledger commits
	usage          []time.Time // usage records
	heartbeats     map[string][]time.Time
	stops          []stopFact
	requeues       map[contracts.Reason]int
	// live and maxHeld count whole GPUs per tenant and pool over the
	// ledger's timeline, for the quota check.
	live    map[string]contracts.Allocation
	held    map[[2]string]int
	maxHeld map[[2]string]int
}

func newRecorder() *recorder {
	return &recorder{firstScheduled: map[string]time.Time{}, last: map[string]contracts.JobEvent{},
		heartbeats: map[string][]time.Time{}, requeues: map[contracts.Reason]int{},
		live: map[string]contracts.Allocation{}, held: map[[2]string]int{}, maxHeld: map[[2]string]int{}}
}

func stamp(m jetstream.Msg) time.Time {
	md, err := m.Metadata()
	if err != nil {
		return time.Now()
	}
	return md.Timestamp
}

// follow tails JOB_EVENTS, ALLOCATIONS and USAGE from their start with
// ordered consumers (they survive a NATS node's loss by recreating
// themselves) and heartbeats with a plain subscription.
func (r *recorder) follow(t *testing.T, ctx context.Context, nc *nats.Conn, js jetstream.JetStream) {
	t.Helper()
	tail := func(stream string, fn func(jetstream.Msg)) {
		cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
		if err != nil {
			t.Fatalf("follow %s: %v", stream, err)
		}
		cc, err := cons.Consume(fn)
		if err != nil {
			t.Fatalf("follow %s: %v", stream, err)
		}
		t.Cleanup(cc.Stop)
	}
	tail(contracts.StreamJobEvents, func(m jetstream.Msg) {
		var ev contracts.JobEvent
		if json.Unmarshal(m.Data(), &ev) != nil {
			return
		}
		at := stamp(m)
		key := ev.Tenant + "/" + ev.JobID
		r.mu.Lock()
		defer r.mu.Unlock()
		if ev.Type == contracts.EventRejected && ev.Reason == contracts.ReasonDuplicateJobID {
			return // a retried submit: the job is unchanged
		}
		r.last[key] = ev
		switch ev.Type {
		case contracts.EventScheduled:
			r.scheduled = append(r.scheduled, at)
			if _, ok := r.firstScheduled[key]; !ok {
				r.firstScheduled[key] = at
			}
		case contracts.EventRequeued, contracts.EventFailed:
			if ev.Type == contracts.EventRequeued {
				r.requeues[ev.Reason]++
			}
			if ev.Reason == contracts.ReasonNodeLost || ev.Reason == contracts.ReasonAgentRestart {
				r.stops = append(r.stops, stopFact{at: at, what: string(ev.Type), job: key, reason: ev.Reason})
			}
		}
	})
	tail(contracts.StreamAllocations, func(m jetstream.Msg) {
		if !strings.HasPrefix(m.Subject(), "gp.alloc.ledger.") {
			return
		}
		var e contracts.LedgerEntry
		if json.Unmarshal(m.Data(), &e) != nil {
			return
		}
		at := stamp(m)
		r.mu.Lock()
		defer r.mu.Unlock()
		a := e.Allocation
		k := [2]string{a.Tenant, a.Pool}
		switch e.Kind {
		case contracts.LedgerCommitted:
			if _, dup := r.live[a.ID]; !dup {
				r.live[a.ID] = a
				r.held[k] += len(a.Devices)
				r.maxHeld[k] = max(r.maxHeld[k], r.held[k])
			}
		case contracts.LedgerReleased:
			if _, ok := r.live[a.ID]; ok {
				delete(r.live, a.ID)
				r.held[k] -= len(a.Devices)
			}
		}
		switch {
		case e.Kind == contracts.LedgerCommitted:
			r.committed = append(r.committed, at)
		case e.Reason == contracts.ReasonNodeLost || e.Reason == contracts.ReasonAgentRestart:
			r.stops = append(r.stops, stopFact{at: at, what: "release", job: a.Tenant + "/" + a.JobID, alloc: a.ID, node: a.NodeID, reason: e.Reason})
		}
	})
	tail(contracts.StreamUsage, func(m jetstream.Msg) {
		at := stamp(m)
		r.mu.Lock()
		r.usage = append(r.usage, at)
		r.mu.Unlock()
	})
	sub, err := nc.Subscribe(contracts.SubjectHeartbeat("*"), func(m *nats.Msg) {
		node := strings.TrimPrefix(m.Subject, contracts.SubjectHeartbeat(""))
		r.mu.Lock()
		r.heartbeats[node] = append(r.heartbeats[node], time.Now())
		r.mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
}

// firstAfter returns the first time in ts at or after t (ts in any order).
func firstAfter(ts []time.Time, t time.Time) (time.Time, bool) {
	var best time.Time
	for _, x := range ts {
		if !x.Before(t) && (best.IsZero() || x.Before(best)) {
			best = x
		}
	}
	return best, !best.IsZero()
}

// lastState is the job's last event, if any.
func (r *recorder) lastState(key string) (contracts.JobEvent, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ev, ok := r.last[key]
	return ev, ok
}

// outputs returns a copy of the useful-output times of service kind, for
// recovery: the scheduler's scheduled events, the resource manager's
// ledger commits, billing's (and Redis's) usage records, a fleet's
// heartbeats of its machines.
func (r *recorder) outputs(kind string, nodes []string) []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch kind {
	case "scheduler":
		return slices.Clone(r.scheduled)
	case "resource-manager":
		return slices.Clone(r.committed)
	case "billing", "redis":
		return slices.Clone(r.usage)
	case "fleet-sim":
		var ts []time.Time
		for _, n := range nodes {
			ts = append(ts, r.heartbeats[n]...)
		}
		return ts
	}
	return nil
}

// percentiles of ds: p50, p99, max.
func percentiles(ds []time.Duration) (p50, p99, mx time.Duration) {
	if len(ds) == 0 {
		return 0, 0, 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	at := func(q float64) time.Duration {
		i := int(q*float64(len(s))+0.5) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	return at(0.50), at(0.99), s[len(s)-1]
}

func fmtPct(ds []time.Duration) string {
	if len(ds) == 0 {
		return "none"
	}
	p50, p99, mx := percentiles(ds)
	return fmt.Sprintf("n=%d p50 %s p99 %s max %s", len(ds), round(p50), round(p99), round(mx))
}

func round(d time.Duration) time.Duration {
	if d < 10*time.Millisecond {
		return d.Round(100 * time.Microsecond)
	}
	return d.Round(time.Millisecond)
}

// consumersDrained says whether every durable consumer of the streams the
// services consume has nothing pending or unacknowledged.
func consumersDrained(ctx context.Context, js jetstream.JetStream) (bool, string) {
	var parts []string
	for _, st := range []string{contracts.StreamJobs, contracts.StreamPlans, contracts.StreamAllocations, contracts.StreamRuns, contracts.StreamNodeCommands} {
		stream, err := js.Stream(ctx, st)
		if err != nil {
			parts = append(parts, fmt.Sprintf("%s: %v", st, err))
			continue
		}
		infos := stream.ListConsumers(ctx)
		for ci := range infos.Info() {
			if ci.Config.Durable != "" && (ci.NumAckPending > 0 || ci.NumPending > 0) {
				parts = append(parts, fmt.Sprintf("%s/%s pending %d unacked %d", st, ci.Name, ci.NumPending, ci.NumAckPending))
			}
		}
		if err := infos.Err(); err != nil {
			parts = append(parts, fmt.Sprintf("%s: %v", st, err))
		}
	}
	sort.Strings(parts)
	return len(parts) == 0, strings.Join(parts, "; ")
}

// consumerDetail describes every durable consumer with work pending on
// the streams the services consume: pending, unacknowledged, pull
// requests waiting (0 with work pending: no client is pulling) and the
// consumer's leader. It is what a stall is waiting on.
func consumerDetail(ctx context.Context, js jetstream.JetStream) string {
	var parts []string
	for _, st := range []string{contracts.StreamJobs, contracts.StreamPlans, contracts.StreamAllocations, contracts.StreamRuns, contracts.StreamNodes} {
		sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		stream, err := js.Stream(sctx, st)
		if err != nil {
			cancel()
			parts = append(parts, fmt.Sprintf("%s: %v", st, err))
			continue
		}
		infos := stream.ListConsumers(sctx)
		for ci := range infos.Info() {
			if ci.Config.Durable == "" || ci.NumPending+uint64(ci.NumAckPending) == 0 {
				continue
			}
			leader := ""
			if ci.Cluster != nil {
				leader = ci.Cluster.Leader
			}
			parts = append(parts, fmt.Sprintf("%s/%s pending %d unacked %d waiting-pulls %d leader %s",
				st, ci.Name, ci.NumPending, ci.NumAckPending, ci.NumWaiting, leader))
		}
		if err := infos.Err(); err != nil {
			parts = append(parts, fmt.Sprintf("%s: %v", st, err))
		}
		cancel()
	}
	sort.Strings(parts)
	if len(parts) == 0 {
		return "no durable consumer has work pending"
	}
	return strings.Join(parts, "; ")
}

// watchStalls logs, once per stall, what the consumers wait on when no
// job has been scheduled for 8 s while some job is open, until ctx ends.
func (r *recorder) watchStalls(ctx context.Context, t *testing.T, js jetstream.JetStream, open func() int) {
	var logged time.Time // the last scheduled event a stall was logged for
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second): // a check a second
		}
		r.mu.Lock()
		last := time.Time{}
		if n := len(r.scheduled); n > 0 {
			last = r.scheduled[n-1]
		}
		r.mu.Unlock()
		if time.Since(last) < 8*time.Second || last.Equal(logged) {
			continue
		}
		if n := open(); n > 0 {
			logged = last
			t.Logf("stall: nothing scheduled for %.0fs with %d jobs open: %s", time.Since(last).Seconds(), n, consumerDetail(ctx, js))
		}
	}
}
