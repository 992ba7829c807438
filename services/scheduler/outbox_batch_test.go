package scheduler

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/state"
)

func TestDistinctKeys(t *testing.T) {
	items := func(keys ...string) []outItem {
		out := make([]outItem, len(keys))
		for i, k := range keys {
			out[i].Key = k
		}
		return out
	}
	for _, tc := range []struct {
		name string
		keys []string
		max  int
		want int
	}{
		{"one", []string{"a"}, 8, 1},
		{"all distinct", []string{"a", "b", "c"}, 8, 3},
		{"stops before a repeated key", []string{"a", "b", "a", "c"}, 8, 2},
		{"repeated at once", []string{"a", "a"}, 8, 1},
		{"bounded", []string{"a", "b", "c", "d"}, 3, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := distinctKeys(items(tc.keys...), tc.max); got != tc.want {
				t.Fatalf("distinctKeys(%v, %d) = %d, want %d", tc.keys, tc.max, got, tc.want)
			}
		})
	}
}

// TestOutboxBatchesKeepEachJobsOrder: the outbox sends many messages
// before their acks, yet every job's events are stored in the order they
// were enqueued, each once, and every waiter hears of its own.
func TestOutboxBatchesKeepEachJobsOrder(t *testing.T) {
	e := newEnv(t)
	o := newOutbox(e.bus, 2, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- o.run(ctx) }()
	const jobs, events = 40, 6
	var dones []chan error
	for k := range events {
		// Each enqueue holds the k-th event of every job, and a few jobs
		// get two in a row: the batch must split there.
		var pubs []state.Publish
		for j := range jobs {
			n := 1
			if j%7 == 0 {
				n = 2
			}
			for r := range n {
				job := fmt.Sprintf("j%d", j)
				pubs = append(pubs, state.Publish{Subject: contracts.SubjectJobEvents("acme", job), Key: "acme/" + job,
					ID: fmt.Sprintf("job/acme/%s/%d/%d", job, k, r), Msg: contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: job}})
			}
		}
		dones = append(dones, o.enqueue(pubs, k%2 == 0)...)
	}
	for i, d := range dones {
		select {
		case err := <-d:
			if err != nil {
				t.Fatalf("waiter %d: %v", i, err)
			}
		case <-ctx.Done():
			t.Fatal("a waiter never heard of its publish")
		}
	}
	want := 0
	for j := range jobs {
		want += events
		if j%7 == 0 {
			want += events
		}
	}
	eventually(t, "every event stored", func() bool { return len(e.events.all()) >= want })
	got := map[string][]string{}
	for _, m := range e.events.all() {
		job := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
		got[job] = append(got[job], m.ID())
	}
	if n := len(e.events.all()); n != want {
		t.Fatalf("%d events stored, want %d", n, want)
	}
	for j := range jobs {
		job := fmt.Sprintf("j%d", j)
		var order []string
		for k := range events {
			order = append(order, fmt.Sprintf("job/acme/%s/%d/0", job, k))
			if j%7 == 0 {
				order = append(order, fmt.Sprintf("job/acme/%s/%d/1", job, k))
			}
		}
		if fmt.Sprint(got[job]) != fmt.Sprint(order) {
			t.Fatalf("job %s stored %v, want %v", job, got[job], order)
		}
	}
	cancel()
	if err := <-ran; err != nil {
		t.Fatalf("outbox ended with %v", err)
	}
}

// TestOutboxBatchStopsRatherThanDropping: a message of a batch that the
// stream refuses (too large) stops the outbox with an error naming it,
// as a lone message does (TestOutboxStopsTheSchedulerRatherThanDropping).
func TestOutboxBatchStopsRatherThanDropping(t *testing.T) {
	e := newEnv(t)
	o := newOutbox(e.bus, 1, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- o.run(ctx) }()
	ev := func(job, msg string) state.Publish {
		return state.Publish{Subject: contracts.SubjectJobEvents("acme", job), Key: "acme/" + job, ID: "job/acme/" + job + "/running/1",
			Msg: contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: job, Message: msg}}
	}
	o.enqueue([]state.Publish{ev("a", ""), ev("big", strings.Repeat("x", 3*contracts.MaxMessageBytes)), ev("c", "")}, false)
	select {
	case err := <-ran:
		if err == nil || !strings.Contains(err.Error(), "job/acme/big/running/1") {
			t.Fatalf("outbox ended with %v; want an error naming the refused event", err)
		}
	case <-ctx.Done():
		t.Fatal("outbox kept running after a publish failed for good")
	}
}
