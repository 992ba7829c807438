package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/e2e/oracle"
)

func seed(t testing.TB) uint64 {
	t.Helper()
	s := uint64(time.Now().UnixNano())
	if v := os.Getenv("GPUPLANE_E2E_SEED"); v != "" {
		var err error
		if s, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("GPUPLANE_E2E_SEED: %v", err)
		}
	}
	t.Logf("seed %d (rerun with GPUPLANE_E2E_SEED=%d)", s, s)
	return s
}

// shapes that fit the default fleet (8×H100, 8×A100 and 4×L4 machines).
var shapes = []contracts.GPURequest{
	{Count: 1, Model: contracts.GPUModelAny},
	{Count: 1, Model: "L4"},
	{Count: 1, Model: "A100-80GB", MemoryMiB: 40000},
	{Count: 2, Model: contracts.GPUModelAny},
	{Count: 2, Model: "H100-80GB"},
	{Count: 4, Model: "A100-80GB"},
	{Count: 4, Model: "L4"},
	{Count: 8, Model: "H100-80GB"},
	{Count: 8, Model: contracts.GPUModelAny},
}

// TestPlatformEndToEnd is the walking skeleton's acceptance test: 200 jobs
// of mixed sizes and tenants through both entry points, with 50+ malformed
// requests on each entry point at the same time; every valid job succeeds,
// every bad one gets its specific reason, and the oracle finds G1, J1 and
// metering intact.
func TestPlatformEndToEnd(t *testing.T) {
	start := time.Now()
	rng := rand.New(rand.NewPCG(seed(t), 7))
	s := startStack(t, nil)
	w := s.watchJobs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	tenants := []string{"acme", "globex", "initech"}
	priorities := []contracts.Priority{"", contracts.PriorityHigh, contracts.PriorityNormal, contracts.PriorityBestEffort, contracts.PriorityCritical}
	jobs := make([]submitted, 200)
	for i := range jobs {
		tenant := tenants[rng.IntN(len(tenants))]
		req := contracts.JobRequest{
			ID:        fmt.Sprintf("job-%03d", i),
			Name:      fmt.Sprintf("mixed %d", i),
			Priority:  priorities[rng.IntN(len(priorities))],
			Resources: contracts.Resources{GPU: shapes[rng.IntN(len(shapes))]},
			Run:       contracts.RunSpec{Duration: contracts.Duration(time.Duration(100+rng.IntN(900)) * time.Millisecond)},
		}
		jobs[i] = submitted{tenant: tenant, id: req.ID, viaAPI: i%2 == 1, req: req}
	}

	var wg sync.WaitGroup
	errs := make(chan error, 1000)

	// The valid workload, both entry points.
	wg.Go(func() {
		for _, j := range jobs {
			body, _ := json.Marshal(j.req)
			if j.viaAPI {
				code, b, err := s.submitAPI(ctx, j.tenant, body)
				if err != nil || code != http.StatusAccepted {
					errs <- fmt.Errorf("API submit %s: %d %s %v", j.id, code, b, err)
				}
				continue
			}
			if _, err := s.submitBus(ctx, j.tenant, contracts.SubmitMsgID(j.tenant, j.id), body); err != nil {
				errs <- fmt.Errorf("bus submit %s: %w", j.id, err)
			}
		}
	})

	// Bad input on the bus, at the same time.
	busCases := BadCases("busbad")
	busSeqs := make([]uint64, len(busCases))
	wg.Go(func() {
		for i, c := range busCases {
			ack, err := s.submitBus(ctx, "acme", fmt.Sprintf("busbad/%d", i), []byte(c.Body))
			if err != nil {
				errs <- fmt.Errorf("bus bad case %q: publish: %w", c.Name, err)
				continue
			}
			busSeqs[i] = ack.Sequence
		}
	})

	// Bad input on the API, at the same time.
	apiCases := BadCases("apibad")
	wg.Go(func() {
		for _, c := range apiCases {
			if c.BusOnly {
				continue
			}
			code, b, err := s.submitAPI(ctx, "acme", []byte(c.Body))
			if err != nil {
				errs <- fmt.Errorf("API bad case %q: %w", c.Name, err)
				continue
			}
			wantCode := http.StatusBadRequest
			if c.Reason == contracts.ReasonTooLarge {
				wantCode = http.StatusRequestEntityTooLarge
			}
			e, derr := apiError(b)
			if code != wantCode || derr != nil || e.Error.Reason != c.Reason {
				errs <- fmt.Errorf("API bad case %q: got %d %s, want %d with reason %s", c.Name, code, strings.TrimSpace(string(b)), wantCode, c.Reason)
			}
		}
		// A tenant that cannot be a subject token is refused in the path.
		code, b, err := s.submitAPI(ctx, "Not.A.Tenant", []byte(`{"id":"x","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`))
		if e, derr := apiError(b); err != nil || code != http.StatusBadRequest || derr != nil || e.Error.Reason != contracts.ReasonInvalidTenant {
			errs <- fmt.Errorf("API bad tenant: %d %s %v", code, b, err)
		}
	})

	// A duplicate ID with another body is rejected; the original runs on.
	dup := contracts.JobRequest{ID: "dup-1", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}, Run: contracts.RunSpec{Duration: contracts.Duration(200 * time.Millisecond)}}
	wg.Go(func() {
		body, _ := json.Marshal(dup)
		if _, err := s.submitBus(ctx, "globex", contracts.SubmitMsgID("globex", "dup-1"), body); err != nil {
			errs <- err
			return
		}
		waitFor(t, time.Minute, "dup-1 queued", func() (bool, string) {
			_, ok := w.get("globex/dup-1")
			return ok, ""
		})
		other := dup
		other.Resources.GPU.Count = 2
		body, _ = json.Marshal(other)
		if _, err := s.submitBus(ctx, "globex", "dup-1-again", body); err != nil {
			errs <- err
		}
	})

	// A subject tenant that is not a valid tenant cannot be answered under
	// its own subject: it is answered on contracts.RejectedSubject(seq)
	// and dead-lettered with the reason.
	badSubj := nats.NewMsg("gp.jobs.submit.BAD_TENANT")
	badSubj.Data = []byte(`{"id":"x","resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`)
	badSubj.Header.Set(contracts.HeaderMsgID, "bad-subject-1")
	if _, err := s.js.PublishMsg(ctx, badSubj); err != nil {
		t.Fatalf("publish on bad subject: %v", err)
	}

	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	submitted := time.Now()
	// On failure, say what the streams hold: refusals explain most stalls.
	t.Cleanup(func() {
		if !t.Failed() && os.Getenv("GPUPLANE_E2E_REFUSALS") == "" {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		rep, err := oracle.Check(ctx, s.nc)
		if err != nil {
			t.Logf("oracle after failure: %v", err)
			return
		}
		t.Logf("after failure: %s", rep.Summary())
		for _, rf := range rep.Refusals {
			t.Logf("refused %s on %s: %s %s", rf.AllocationID, rf.NodeID, rf.Reason, rf.Message)
		}
	})

	// Every valid job succeeds.
	waitFor(t, 3*time.Minute, "all 200 jobs to succeed", func() (bool, string) {
		return w.progress(jobs)
	})
	allDone := time.Now()
	for _, j := range jobs {
		ev, _ := w.get(j.tenant + "/" + j.id)
		if ev.ExitCode == nil || *ev.ExitCode != 0 || ev.StartedAt == nil || ev.EndedAt == nil {
			t.Errorf("job %s/%s succeeded without exit code 0 and run times: %+v", j.tenant, j.id, ev)
		}
	}
	if ev, ok := w.get("globex/dup-1#duplicate"); !ok || ev.Reason != contracts.ReasonDuplicateJobID {
		t.Errorf("duplicate ID with another body: got %+v, want a rejected event with %s", ev, contracts.ReasonDuplicateJobID)
	}
	waitFor(t, time.Minute, "dup-1 to succeed", func() (bool, string) {
		ev, _ := w.get("globex/dup-1")
		return ev.State == contracts.StateSucceeded, string(ev.State)
	})

	// Every bad bus request got its specific reason.
	waitFor(t, 30*time.Second, "a rejection for every bad bus request", func() (bool, string) {
		var missing []string
		for i, c := range busCases {
			ev, ok := w.get("acme/" + c.ID)
			if !ok || ev.Type != contracts.EventRejected {
				ev, ok = w.get("acme/" + contracts.RejectedJobID(busSeqs[i]))
			}
			if !ok {
				missing = append(missing, c.Name)
			}
		}
		return len(missing) == 0, fmt.Sprintf("no rejection yet for %v", missing)
	})
	for i, c := range busCases {
		ev, ok := w.get("acme/" + c.ID)
		if !ok || ev.Type != contracts.EventRejected {
			ev = mustGet(w, "acme/"+contracts.RejectedJobID(busSeqs[i]))
		}
		if ev.Type != contracts.EventRejected || ev.State != contracts.StateRejected || ev.Reason != c.Reason || len(ev.Errors) == 0 {
			t.Errorf("bus bad case %q: got %s reason %q errors %v, want rejected with %s", c.Name, ev.Type, ev.Reason, ev.Errors, c.Reason)
		}
	}
	checkDeadLetter(t, s, "gp.jobs.submit.BAD_TENANT")

	// Billing catches up, then the oracle checks the whole history.
	var rep *oracle.Report
	waitFor(t, time.Minute, "usage records for every run", func() (bool, string) {
		var err error
		if rep, err = oracle.Check(ctx, s.nc); err != nil {
			return false, err.Error()
		}
		ran := 0
		for _, r := range rep.Runs {
			if r.Ended > 0 && !r.StartedAt.IsZero() {
				ran++
			}
		}
		// A job preempted (the workload mixes classes on a full fleet)
		// runs again as its next attempt: more runs than jobs. An extra
		// run has its own allocation, so its own attempt; the oracle's J1
		// check below holds every allocation to one start and every
		// attempt change to the state machine (a requeued event).
		return ran >= len(jobs)+1 && len(rep.Usage) == ran, fmt.Sprintf("%d runs ended, %d billed", ran, len(rep.Usage))
	})
	billed, expected := rep.CheckMetering()
	if err := rep.Err(); err != nil {
		t.Fatal(err)
	}
	if billed != expected || billed == 0 {
		t.Fatalf("billed %d GPU-ms, runs used %d GPU-ms", billed, expected)
	}
	t.Logf("oracle: %s; billed %.1f GPU-s = run time × GPUs", rep.Summary(), float64(billed)/1000)

	// The gateway's read models agree.
	// The gateway's read models follow the streams, so they may lag a
	// moment behind the oracle's replay: poll until they agree.
	var want int64
	for _, recs := range rep.Usage {
		for _, rec := range recs { // one per segment: a run may cross midnight
			if rec.Tenant == "globex" {
				want += rec.GPUMillis
			}
		}
	}
	waitFor(t, 10*time.Second, "the gateway's usage to match the oracle", func() (bool, string) {
		var usage contracts.UsageSummary
		getJSON(t, s.ep.GatewayURL+"/v1/tenants/globex/usage", &usage)
		return usage.GPUMillis == want, fmt.Sprintf("gateway %d GPU-ms, oracle %d", usage.GPUMillis, want)
	})
	waitFor(t, 10*time.Second, "the gateway's job status", func() (bool, string) {
		var st contracts.JobStatus
		getJSON(t, s.ep.GatewayURL+"/v1/tenants/"+jobs[0].tenant+"/jobs/"+jobs[0].id, &st)
		return st.State == contracts.StateSucceeded && st.Placement != nil, fmt.Sprintf("%+v", st)
	})
	resp, err := http.Get(s.ep.MetricsURL)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Errorf("metrics endpoint: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	w.mu.Lock()
	t.Logf("job events by type: %v", w.counts)
	w.mu.Unlock()
	t.Logf("timing: submit %.1fs, all succeeded after %.1fs, whole test %.1fs",
		submitted.Sub(start).Seconds(), allDone.Sub(start).Seconds(), time.Since(start).Seconds())
}

func mustGet(w *jobWatcher, key string) contracts.JobEvent {
	ev, _ := w.get(key)
	return ev
}

func getJSON(t testing.TB, url string, v any) {
	t.Helper()
	resp, err := authClient.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: decode: %v", url, err)
	}
}

// checkDeadLetter waits for a dead-lettered copy of a message published on
// subject, with a reason.
func checkDeadLetter(t *testing.T, s *stack, subject string) {
	t.Helper()
	waitFor(t, 30*time.Second, "dead letter for "+subject, func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		stream, err := s.js.Stream(ctx, contracts.StreamDeadLetters)
		if err != nil {
			return false, err.Error()
		}
		info, err := stream.Info(ctx)
		if err != nil || info.State.Msgs == 0 {
			return false, "no dead letters"
		}
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
			m, err := stream.GetMsg(ctx, seq)
			if err != nil {
				continue
			}
			if m.Header.Get(contracts.HeaderDeadLetterSubject) == subject && m.Header.Get(contracts.HeaderDeadLetterReason) != "" {
				return true, ""
			}
		}
		return false, "not among the dead letters"
	})
}
