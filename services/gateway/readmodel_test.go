package gateway

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// readModelImpls are the implementations every read-model test runs
// against; a shared (Redis) model joins this list.
var readModelImpls = map[string]func(t *testing.T) readModel{
	"memory": func(*testing.T) readModel { return newMemoryModel() },
}

func TestReadModelFoldsIdempotently(t *testing.T) {
	for name, newModel := range readModelImpls {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			m := newModel(t)
			apply := func(ev contracts.JobEvent, seq uint64) error {
				return m.ApplyJobEvent(ctx, ev.Tenant, ev.JobID, ev, seq)
			}
			q := queued("acme", "j1", t0)
			if err := apply(q, 1); err != nil {
				t.Fatal(err)
			}
			if err := apply(q, 1); !errors.Is(err, contracts.ErrStaleEvent) {
				t.Fatalf("replayed event: err %v, want ErrStaleEvent", err)
			}
			dup := contracts.JobEvent{Type: contracts.EventRejected, Tenant: "acme", JobID: "j1", Time: t0, Reason: contracts.ReasonDuplicateJobID}
			if err := apply(dup, 2); !errors.Is(err, contracts.ErrTransition) {
				t.Fatalf("duplicate-ID rejection of an accepted job: err %v, want ErrTransition", err)
			}
			exit := 3
			end := t0.Add(time.Minute)
			for seq, ev := range []contracts.JobEvent{
				{Type: contracts.EventScheduled, Tenant: "acme", JobID: "j1", Attempt: 1, Time: t0.Add(time.Second)},
				{Type: contracts.EventRunning, Tenant: "acme", JobID: "j1", Attempt: 1, Time: t0.Add(2 * time.Second)},
				{Type: contracts.EventFailed, Tenant: "acme", JobID: "j1", Attempt: 1, Time: end, ExitCode: &exit, EndedAt: &end, Reason: contracts.ReasonExitNonZero},
			} {
				if err := apply(ev, uint64(seq)+3); err != nil {
					t.Fatalf("%s: %v", ev.Type, err)
				}
			}
			got, err := m.Job(ctx, "acme", "j1")
			if err != nil {
				t.Fatal(err)
			}
			want := contracts.JobStatus{Tenant: "acme", JobID: "j1", Name: "resnet", State: contracts.StateFailed, Attempt: 1,
				Reason: contracts.ReasonExitNonZero, Request: q.Request, ExitCode: &exit, CreatedAt: t0, UpdatedAt: end, EndedAt: &end, LastSeq: 5}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("folded status (-want +got):\n%s", diff)
			}
			if _, err := m.Job(ctx, "acme", "nope"); !errors.Is(err, errUnknownJob) {
				t.Fatalf("unknown job: %v", err)
			}
			if _, err := m.Job(ctx, "other", "j1"); !errors.Is(err, errUnknownJob) {
				t.Fatalf("another tenant's job: %v", err)
			}
		})
	}
}

func TestReadModelListsNewestFirst(t *testing.T) {
	for name, newModel := range readModelImpls {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			m := newModel(t)
			for i, id := range []string{"b", "a", "c", "d"} {
				at := t0.Add(time.Duration(i) * time.Second)
				if id == "a" {
					at = t0 // same time as b: ties break by ID
				}
				if err := m.ApplyJobEvent(ctx, "acme", id, queued("acme", id, at), uint64(i+1)); err != nil {
					t.Fatal(err)
				}
			}
			if err := m.ApplyJobEvent(ctx, "acme", "c", contracts.JobEvent{Type: contracts.EventCancelled, Tenant: "acme", JobID: "c", Attempt: 1, Time: t0.Add(time.Hour)}, 9); err != nil {
				t.Fatal(err)
			}
			ids := func(q jobQuery) []string {
				jobs, err := m.Jobs(ctx, "acme", q)
				if err != nil {
					t.Fatal(err)
				}
				out := []string{}
				for _, j := range jobs {
					out = append(out, j.JobID)
				}
				return out
			}
			tests := map[string]struct {
				q    jobQuery
				want []string
			}{
				"all":       {jobQuery{}, []string{"d", "c", "a", "b"}},
				"limit":     {jobQuery{Limit: 2}, []string{"d", "c"}},
				"queued":    {jobQuery{State: contracts.StateQueued}, []string{"d", "a", "b"}},
				"cancelled": {jobQuery{State: contracts.StateCancelled, Limit: 5}, []string{"c"}},
				"running":   {jobQuery{State: contracts.StateRunning}, []string{}},
				// Paging: the jobs after the cursor, whatever its state.
				"after":        {jobQuery{After: "c", Limit: 1}, []string{"a"}},
				"queued after": {jobQuery{State: contracts.StateQueued, After: "c"}, []string{"a", "b"}},
				"after last":   {jobQuery{After: "b"}, []string{}},
			}
			for name, tt := range tests {
				if diff := cmp.Diff(tt.want, ids(tt.q)); diff != "" {
					t.Errorf("%s (-want +got):\n%s", name, diff)
				}
			}
		})
	}
}

func TestReadModelUsageCountsEachRecordOnce(t *testing.T) {
	for name, newModel := range readModelImpls {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			m := newModel(t)
			r1 := contracts.UsageRecord{ID: "usage/a1", Tenant: "acme", Start: t0.Add(time.Second), GPUMillis: 1500}
			r2 := contracts.UsageRecord{ID: "usage/a2", Tenant: "acme", Start: t0, GPUMillis: 250}
			for i, r := range []contracts.UsageRecord{r1, r2, r1} {
				isNew, err := m.ApplyUsage(ctx, "acme", r, t0)
				if err != nil || isNew != (i < 2) {
					t.Fatalf("record %d: new %v err %v", i, isNew, err)
				}
			}
			if _, err := m.ApplyUsage(ctx, "acme", contracts.UsageRecord{}, t0); err == nil {
				t.Fatal("a record without an ID was accepted")
			}
			got, err := m.Usage(ctx, "acme")
			if err != nil {
				t.Fatal(err)
			}
			want := contracts.UsageSummary{Tenant: "acme", GPUSeconds: 1.75, GPUMillis: 1750, Records: 2, ByJob: []contracts.UsageRecord{r2, r1}}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("usage (-want +got):\n%s", diff)
			}
			if got, _ := m.Usage(ctx, "nobody"); got.Tenant != "nobody" || got.Records != 0 || got.ByJob == nil {
				t.Fatalf("unknown tenant: %+v (ByJob must be [] in JSON)", got)
			}
		})
	}
}
