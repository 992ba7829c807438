package gpuplane_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// fast retries, so the tests of retrying do not wait seconds.
var fast = gpuplane.WithRetry(gpuplane.RetryPolicy{MaxAttempts: 3, BaseDelay: 10 * time.Millisecond, MaxDelay: 50 * time.Millisecond})

// job is a simulated run of d on one GPU.
func job(id string, d time.Duration) contracts.JobRequest {
	return contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
		Run: contracts.RunSpec{Duration: contracts.Duration(d)}}
}

// TestWatchResumesAfterACutConnection: the connection of a watch is cut
// in the middle of an event, after two whole ones; the watch reconnects
// with Last-Event-ID of the last whole event, and yields exactly the
// job's events, none lost, none twice (the same as a watch of the ended
// job in one piece).
func TestWatchResumesAfterACutConnection(t *testing.T) {
	ctx := testContext(t)
	p := newProxy(t)
	c := client(t, p.srv.URL, gpuplane.WithToken(adminToken), fast)
	const tenant, id = "watch-cut", "w1"
	events := tenantPathOf(tenant, "jobs", id, "events")
	p.on(http.MethodGet, events, cutStream)
	if _, err := c.Submit(ctx, tenant, job(id, 2*time.Second)); err != nil {
		t.Fatal(err)
	}
	var got []gpuplane.Event
	for ev, err := range c.Watch(ctx, tenant, id, gpuplane.WatchOptions{}) {
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ev)
	}
	ids := p.lastEventIDs()
	if len(ids) < 2 || ids[0] != "" || ids[1] != strconv.FormatUint(got[sseEventsCut-1].Seq, 10) {
		t.Fatalf("Last-Event-ID of each connection %q; want none, then %d (the second event's)", ids, got[sseEventsCut-1].Seq)
	}
	// The whole story, read in one piece now that the job has ended.
	var want []gpuplane.Event
	for ev, err := range admin(t).Watch(ctx, tenant, id, gpuplane.WatchOptions{}) {
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, ev)
	}
	summary := func(evs []gpuplane.Event) []string {
		var out []string
		for _, e := range evs {
			out = append(out, fmt.Sprintf("%d %s", e.Seq, e.Event.Type))
		}
		return out
	}
	if diff := cmp.Diff(summary(want), summary(got)); diff != "" {
		t.Errorf("events across the cut (-whole +got):\n%s", diff)
	}
	if last := got[len(got)-1].Event.Type; last != contracts.EventSucceeded {
		t.Errorf("the watch ended at %s, want at succeeded", last)
	}

	// Resuming after the second event: the rest, from the third.
	var rest []gpuplane.Event
	for ev, err := range admin(t).Watch(ctx, tenant, id, gpuplane.WatchOptions{After: want[1].Seq}) {
		if err != nil {
			t.Fatal(err)
		}
		rest = append(rest, ev)
	}
	if diff := cmp.Diff(summary(want[2:]), summary(rest)); diff != "" {
		t.Errorf("resumed after %d (-want +got):\n%s", want[1].Seq, diff)
	}
}

// TestWatchGivesUpOnARefusal: a watch of a tenant the caller may not
// read ends with the 403, without reconnecting.
func TestWatchGivesUpOnARefusal(t *testing.T) {
	ctx := testContext(t)
	p := newProxy(t)
	c := client(t, p.srv.URL, gpuplane.WithToken(demoToken), fast)
	var errs []error
	for _, err := range c.Watch(ctx, "not-acme", "w1", gpuplane.WatchOptions{}) {
		errs = append(errs, err)
	}
	if len(errs) != 1 || !gpuplane.IsForbidden(errs[0]) {
		t.Fatalf("watch of another tenant: %v, want one 403", errs)
	}
	if n := p.count(http.MethodGet, tenantPathOf("not-acme", "jobs", "w1", "events")); n != 1 {
		t.Errorf("%d connections, want 1", n)
	}
}

// TestListPagesThroughEveryJob: pages of two jobs, each after the last
// one of the previous page, cover every job once, newest first, as one
// page of all does; a short page ends it.
func TestListPagesThroughEveryJob(t *testing.T) {
	ctx := testContext(t)
	c := admin(t)
	const tenant = "paging"
	for i := range 5 {
		if _, err := c.Submit(ctx, tenant, job(fmt.Sprintf("p%d", i), time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	var all gpuplane.JobPage
	eventually(t, "five jobs listed", func() bool {
		var err error
		all, err = c.ListJobs(ctx, tenant, gpuplane.ListOptions{})
		return err == nil && len(all.Jobs) == 5
	})
	if all.Next != "" {
		t.Errorf("a page of 5 of up to 100 says more follow after %s", all.Next)
	}
	ids := func(jobs []contracts.JobStatus) []string {
		out := []string{}
		for _, j := range jobs {
			out = append(out, j.JobID)
		}
		return out
	}

	var pages [][]string
	opts := gpuplane.ListOptions{Limit: 2}
	for {
		page, err := c.ListJobs(ctx, tenant, opts)
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, ids(page.Jobs))
		if page.Next == "" {
			break
		}
		if page.Next != page.Jobs[len(page.Jobs)-1].JobID {
			t.Fatalf("next %q, want the page's last job", page.Next)
		}
		opts.After = page.Next
	}
	want := ids(all.Jobs)
	if diff := cmp.Diff([][]string{want[0:2], want[2:4], want[4:]}, pages); diff != "" {
		t.Errorf("pages (-want +got):\n%s", diff)
	}

	var iterated []contracts.JobStatus
	for j, err := range c.Jobs(ctx, tenant, gpuplane.ListOptions{Limit: 2}) {
		if err != nil {
			t.Fatal(err)
		}
		iterated = append(iterated, j)
	}
	if diff := cmp.Diff(want, ids(iterated)); diff != "" {
		t.Errorf("Jobs (-want +got):\n%s", diff)
	}
	// Breaking off the iteration stops it.
	n := 0
	for range c.Jobs(ctx, tenant, gpuplane.ListOptions{Limit: 2}) {
		if n++; n == 3 {
			break
		}
	}

	_, err := c.ListJobs(ctx, tenant, gpuplane.ListOptions{After: "no-such-job"})
	if ae, ok := gpuplane.AsAPIError(err); !ok || ae.StatusCode != http.StatusBadRequest || ae.Field("after") == nil {
		t.Errorf("a page after an unknown job: %v, want 400 on field after", err)
	}
}

// TestTypedErrors: every refusal is an *APIError with the gateway's
// status, stable reason and field errors, found with errors.As and the
// helpers.
func TestTypedErrors(t *testing.T) {
	ctx := testContext(t)
	demo := client(t, gatewayURL, gpuplane.WithToken(demoToken))
	for name, tt := range map[string]struct {
		call   func() error
		status int
		reason contracts.Reason
		is     func(error) bool
		fields map[string]contracts.Reason
	}{
		"rejected submit": {
			call: func() error {
				_, err := demo.SubmitJSON(ctx, "acme", []byte(`{"id":"bad-1","resources":{"gpu":{"count":2,"model":"TPU"}},"run":{"duration":"soon"}}`))
				return err
			},
			status: http.StatusBadRequest, reason: contracts.ReasonInvalidRequest, is: gpuplane.IsInvalid,
			fields: map[string]contracts.Reason{"resources.gpu.model": contracts.ReasonInvalidValue, "run.duration": contracts.ReasonInvalidDuration},
		},
		"unknown job": {
			call:   func() error { _, err := demo.Job(ctx, "acme", "ghost"); return err },
			status: http.StatusNotFound, reason: contracts.ReasonUnknownJob, is: gpuplane.IsNotFound,
		},
		"unknown node": {
			call:   func() error { _, err := demo.Node(ctx, "ghost-node"); return err },
			status: http.StatusNotFound, reason: contracts.ReasonUnknownNode, is: gpuplane.IsNotFound,
		},
		"another tenant's job": {
			call:   func() error { _, err := demo.Job(ctx, "other", "j1"); return err },
			status: http.StatusForbidden, reason: contracts.ReasonForbidden, is: gpuplane.IsForbidden,
		},
		"an admin call": {
			call: func() error {
				_, err := demo.SetPool(ctx, "l4", contracts.PoolConfig{Policy: "spread"}, nil)
				return err
			},
			status: http.StatusForbidden, reason: contracts.ReasonForbidden, is: gpuplane.IsForbidden,
		},
		"a bad token": {
			call: func() error {
				_, err := client(t, gatewayURL, gpuplane.WithToken("gpt_nope")).WhoAmI(ctx)
				return err
			},
			status: http.StatusUnauthorized, is: gpuplane.IsUnauthenticated,
		},
		"no token": {
			call:   func() error { _, err := client(t, gatewayURL).Usage(ctx, "acme"); return err },
			status: http.StatusUnauthorized, reason: contracts.ReasonUnauthenticated, is: gpuplane.IsUnauthenticated,
		},
		"a checkpoint of a job not running": {
			call: func() error {
				if _, err := demo.Submit(ctx, "acme", job("ckpt-queued", time.Second)); err != nil {
					return err
				}
				if _, err := demo.Wait(ctx, "acme", "ckpt-queued"); err != nil {
					return err
				}
				_, err := demo.CheckpointJob(ctx, "acme", "ckpt-queued")
				return err
			},
			status: http.StatusConflict, reason: contracts.ReasonNotRunning, is: gpuplane.IsConflict,
		},
	} {
		t.Run(name, func(t *testing.T) {
			err := tt.call()
			var ae *gpuplane.APIError
			if !errors.As(err, &ae) {
				t.Fatalf("%v (%T): not an *APIError", err, err)
			}
			if ae.StatusCode != tt.status || (tt.reason != "" && ae.Reason != tt.reason) || !tt.is(err) {
				t.Errorf("%v: want HTTP %d %s", err, tt.status, tt.reason)
			}
			if gpuplane.ReasonOf(err) != ae.Reason {
				t.Errorf("ReasonOf %q, want %q", gpuplane.ReasonOf(err), ae.Reason)
			}
			got := map[string]contracts.Reason{}
			for field := range tt.fields {
				if f := ae.Field(field); f != nil {
					got[field] = f.Reason
				}
			}
			if len(tt.fields) > 0 {
				if diff := cmp.Diff(tt.fields, got); diff != "" {
					t.Errorf("field errors (-want +got):\n%s\nall: %+v", diff, ae.Fields)
				}
			}
		})
	}
	// Refused before sending: the caller's own check, in the same type.
	_, verr := contracts.DecodeJobRequest([]byte(`{"resources":{"gpu":{"count":-1}}}`), "acme")
	err := gpuplane.ValidationError(verr, "checked before sending")
	if ae, ok := gpuplane.AsAPIError(err); !ok || ae.StatusCode != 0 || !gpuplane.IsInvalid(err) || ae.Field("resources.gpu.count") == nil {
		t.Errorf("a local refusal: %v", err)
	}
}

// TestRetries: what is sent again, and what is not. A submit whose answer
// was lost after the gateway acted is sent again and is the same job.
func TestRetries(t *testing.T) {
	ctx := testContext(t)
	c := admin(t)
	const tenant = "retries"
	if _, err := c.Submit(ctx, tenant, job("r-base", time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Wait(ctx, tenant, "r-base"); err != nil {
		t.Fatal(err)
	}
	jobPath := tenantPathOf(tenant, "jobs", "r-base")
	jobsPath := tenantPathOf(tenant, "jobs")
	ckptPath := tenantPathOf(tenant, "jobs", "r-base", "checkpoint")
	for name, tt := range map[string]struct {
		method, path string
		faults       []fault
		call         func(*gpuplane.Client) error
		// attempts the proxy sees; ok: the call succeeds.
		attempts int
		ok       bool
		is       func(error) bool
	}{
		"read after a 503": {http.MethodGet, jobPath, []fault{unavailable},
			func(c *gpuplane.Client) error { _, err := c.Job(ctx, tenant, "r-base"); return err }, 2, true, nil},
		"read after a reset connection": {http.MethodGet, jobPath, []fault{dropRequest},
			func(c *gpuplane.Client) error { _, err := c.Job(ctx, tenant, "r-base"); return err }, 2, true, nil},
		"read, still unavailable after every attempt": {http.MethodGet, jobPath, []fault{unavailable, unavailable, unavailable},
			func(c *gpuplane.Client) error { _, err := c.Job(ctx, tenant, "r-base"); return err }, 3, false, gpuplane.IsUnavailable},
		"checkpoint after a 503: not repeated": {http.MethodPost, ckptPath, []fault{unavailable},
			func(c *gpuplane.Client) error { _, err := c.CheckpointJob(ctx, tenant, "r-base"); return err }, 1, false, gpuplane.IsUnavailable},
		"checkpoint after a 429: repeated, the gateway had not acted": {http.MethodPost, ckptPath, []fault{rateLimited},
			// The job has ended: the gateway's own answer, the second time.
			func(c *gpuplane.Client) error { _, err := c.CheckpointJob(ctx, tenant, "r-base"); return err }, 2, false, gpuplane.IsConflict},
		"submit without an ID after a reset: not repeated": {http.MethodPost, jobsPath, []fault{dropRequest},
			func(c *gpuplane.Client) error {
				_, err := c.SubmitJSON(ctx, tenant, []byte(`{"resources":{"gpu":{"count":1}},"run":{"duration":"1s"}}`))
				return err
			}, 1, false, nil},
	} {
		t.Run(name, func(t *testing.T) {
			p := newProxy(t)
			p.on(tt.method, tt.path, tt.faults...)
			err := tt.call(client(t, p.srv.URL, gpuplane.WithToken(adminToken), fast))
			if (err == nil) != tt.ok || (tt.is != nil && !tt.is(err)) {
				t.Errorf("err %v, want ok %v", err, tt.ok)
			}
			if n := p.count(tt.method, tt.path); n != tt.attempts {
				t.Errorf("%d attempts, want %d", n, tt.attempts)
			}
		})
	}

	t.Run("submit whose answer was lost", func(t *testing.T) {
		p := newProxy(t)
		p.on(http.MethodPost, jobsPath, dropAnswer)
		res, err := client(t, p.srv.URL, gpuplane.WithToken(adminToken), fast).Submit(ctx, tenant, job("r-once", time.Second))
		if err != nil {
			t.Fatal(err)
		}
		if n := p.count(http.MethodPost, jobsPath); n != 2 || !res.Duplicate || res.JobID != "r-once" {
			t.Fatalf("%d attempts, answer %+v; want 2, the second a duplicate of r-once", n, res)
		}
		if _, err := c.Wait(ctx, tenant, "r-once"); err != nil {
			t.Fatal(err)
		}
		var runs int
		for j, err := range c.Jobs(ctx, tenant, gpuplane.ListOptions{}) {
			if err != nil {
				t.Fatal(err)
			}
			if j.JobID == "r-once" {
				runs++
				if j.Attempt != 1 {
					t.Errorf("r-once ran %d attempts, want 1", j.Attempt)
				}
			}
		}
		if runs != 1 {
			t.Errorf("%d jobs r-once, want 1", runs)
		}
	})
}

// TestStoredLogin: a program uses the login gpuctl stored, and says how
// to log in when there is none.
func TestStoredLogin(t *testing.T) {
	ctx := testContext(t)
	dir := t.TempDir()
	c := client(t, gatewayURL, gpuplane.WithTokenSource(gpuplane.StoredLogin(dir, gatewayURL+"/")))
	if _, err := c.WhoAmI(ctx); err == nil || gpuplane.IsUnauthenticated(err) {
		t.Fatalf("without a login: %v, want an error before sending", err)
	}
	if err := gpuplane.SaveCredential(dir, gatewayURL, gpuplane.Credential{Token: demoToken, Method: "token"}); err != nil {
		t.Fatal(err)
	}
	who, err := c.WhoAmI(ctx)
	if err != nil || !slices.Contains(who.Bindings, contracts.Binding{Role: contracts.RoleMember, Tenant: "acme"}) {
		t.Fatalf("whoami with the stored login: %+v %v", who, err)
	}
	st, err := os.Stat(filepath.Join(dir, "credentials.json"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("credentials file: %v %v, want mode 600", st, err)
	}
	env := map[string]string{"GPUPLANE_CONFIG_DIR": dir}
	who, err = client(t, gatewayURL, gpuplane.WithTokenSource(gpuplane.DefaultTokenSource(gatewayURL, func(k string) string { return env[k] }))).WhoAmI(ctx)
	if err != nil || who.Subject != "token:demo-acme" {
		t.Errorf("DefaultTokenSource: %+v %v", who, err)
	}
}

// tenantPathOf is the path of a tenant's resource, as the client sends it.
func tenantPathOf(tenant string, elems ...string) string {
	p := "/v1/tenants/" + tenant
	for _, e := range elems {
		p += "/" + e
	}
	return p
}

// TestWatchTenantResumes: the tenant's event stream, cut in the middle of
// an event, resumes after the last whole one; it goes on until its
// context ends, which ends the sequence with the context's error.
func TestWatchTenantResumes(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	p := newProxy(t)
	c := client(t, p.srv.URL, gpuplane.WithToken(adminToken), fast)
	const tenant = "watch-tenant"
	p.on(http.MethodGet, tenantPathOf(tenant, "events"), cutStream)
	if _, err := c.Submit(ctx, tenant, job("t1", time.Second)); err != nil {
		t.Fatal(err)
	}
	var got []string
	var last uint64
	var end error
	for ev, err := range c.WatchTenant(ctx, tenant, gpuplane.WatchOptions{}) {
		if err != nil {
			end = err
			break
		}
		if ev.Seq <= last {
			t.Errorf("event %d after %d", ev.Seq, last)
		}
		last = ev.Seq
		got = append(got, string(ev.Event.Type))
		if ev.Event.Type == contracts.EventSucceeded {
			cancel()
		}
	}
	if !errors.Is(end, context.Canceled) {
		t.Errorf("the watch ended with %v, want the context's end", end)
	}
	if diff := cmp.Diff([]string{"queued", "scheduled", "running", "succeeded"}, got); diff != "" {
		t.Errorf("tenant events (-want +got):\n%s", diff)
	}
	if ids := p.lastEventIDs(); len(ids) < 2 || ids[1] == "" {
		t.Errorf("Last-Event-ID of each connection %q: want the reconnect to resume", ids)
	}
}
