package console

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/gpuplane/gpuplane/contracts"
)

// The jobs the page tests look for, submitted once through the REST API
// as the platform admin for tenant acme (the demo tenant of make run).
const (
	tenant = "acme"
	// longJob runs on one H100 for the whole package: it owns a GPU on
	// the fleet page and is listed on the jobs page.
	longJob = "console-long"
	// shortJob ran and ended, so the cost page has usage to show.
	shortJob = "console-short"
	// pendingJob asks for more GPUs than any machine has and waits for
	// ever, with the scheduler's reason.
	pendingJob = "console-pending"
)

// fixture is what the jobs above became.
type fixture struct {
	long    contracts.JobStatus // running, with its placement
	pending contracts.JobDescription
}

var (
	fixtureOnce sync.Once
	fixtureVal  fixture
	fixtureErr  error
)

// jobs submits the fixture's jobs (once per package) and waits until the
// long one runs, the short one has been billed and the pending one has
// its reason.
func (s *stack) jobs(t *testing.T) fixture {
	t.Helper()
	fixtureOnce.Do(func() { fixtureVal, fixtureErr = s.makeFixture() })
	if fixtureErr != nil {
		t.Fatal(fixtureErr)
	}
	return fixtureVal
}

func (s *stack) makeFixture() (fixture, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*waitFor)
	defer cancel()
	h100 := contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}}
	reqs := []contracts.JobRequest{
		{ID: longJob, Name: "the console's long job", Resources: h100,
			Run: contracts.RunSpec{Duration: contracts.Duration(time.Hour), Checkpoint: true}},
		{ID: shortJob, Resources: h100, Run: contracts.RunSpec{Duration: contracts.Duration(time.Second)}},
		// Nine H100s on one machine of eight: never placed.
		{ID: pendingJob, Name: "waits for a machine that does not exist",
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 9, Model: "H100-80GB"}},
			Run:       contracts.RunSpec{Duration: contracts.Duration(time.Minute)}},
	}
	for _, r := range reqs {
		if _, err := s.admin.Submit(ctx, tenant, r); err != nil {
			return fixture{}, fmt.Errorf("submit %s: %w", r.ID, err)
		}
	}
	var f fixture
	err := poll(ctx, "the fixture's jobs", func() (bool, string) {
		long, err := s.admin.Job(ctx, tenant, longJob)
		if err != nil || long.State != contracts.StateRunning || long.Placement == nil {
			return false, fmt.Sprintf("%s: %s %v", longJob, long.State, err)
		}
		short, err := s.admin.Job(ctx, tenant, shortJob)
		if err != nil || short.State != contracts.StateSucceeded {
			return false, fmt.Sprintf("%s: %s %v", shortJob, short.State, err)
		}
		pending, err := s.admin.DescribeJob(ctx, tenant, pendingJob)
		if err != nil || pending.Pending == nil || pending.Pending.Message == "" {
			return false, fmt.Sprintf("%s: %+v %v", pendingJob, pending.Pending, err)
		}
		usage, err := s.admin.Usage(ctx, tenant)
		if err != nil || usage.GPUSeconds <= 0 {
			return false, fmt.Sprintf("usage %+v %v", usage, err)
		}
		f.long, f.pending = long, pending
		return true, ""
	})
	return f, err
}

// poll waits, bounded by ctx, until cond holds.
func poll(ctx context.Context, what string, cond func() (bool, string)) error {
	var last string
	for {
		ok, why := cond()
		if ok {
			return nil
		}
		last = why
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: not in time; last: %s", what, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// eventually is poll for a test, bounded by waitFor.
func eventually(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	if err := poll(ctx, what, cond); err != nil {
		t.Fatal(err)
	}
}

// login signs the tab in as the console does: the token form of the
// login view, with the token make run writes (admin.token or
// demo-acme.token).
func (b *tab) login(token string) {
	b.t.Helper()
	b.navigate("/")
	b.until("the login view", `document.querySelector('[data-testid=login-token]')`)
	b.do(chromedp.SendKeys(chromedp.CSS(`[data-testid=login-token]`), token),
		chromedp.Click(chromedp.CSS(`[data-testid=token-submit]`)))
	b.until("signed in", `(document.querySelector('[data-testid=whoami]') || {}).textContent`)
}

// contains is a JavaScript test that the main view's text has every one
// of words.
func contains(words ...string) string {
	var parts []string
	for _, w := range words {
		parts = append(parts, fmt.Sprintf("t.includes(%s)", jsString(w)))
	}
	return "(() => { const m = document.querySelector('main'); const t = m ? m.innerText : ''; return " +
		strings.Join(parts, " && ") + "; })()"
}
