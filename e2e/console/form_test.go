package console

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// field is the CSS selector of the submit form's input for an API field.
func field(path string) chromedp.CSS {
	return chromedp.CSS(fmt.Sprintf(`[data-testid="field-%s"]`, path))
}

// setField replaces the value of the form's input for path (a text or
// number input) by typing, as a user would.
func (b *tab) setField(path, value string) {
	b.t.Helper()
	// Emptied first (chromedp's Clear leaves a number input's value).
	_ = eval[bool](b, fmt.Sprintf(`(() => { const e = document.querySelector('[data-testid="field-%s"]'); e.value = ''; return true; })()`, path))
	b.do(chromedp.SendKeys(field(path), value))
	if got := eval[string](b, fmt.Sprintf(`document.querySelector('[data-testid="field-%s"]').value`, path)); got != value {
		b.fail("typed %q into %s, it holds %q", value, path, got)
	}
}

// TestSubmittedJobGoesToSucceededLive: the demo user of tenant acme fills
// the submit form (an L4 for 3 s), submits, lands on the job's page and
// watches it run and succeed there without a reload; the jobs list shows
// it succeeded too.
func TestSubmittedJobGoesToSucceededLive(t *testing.T) {
	s := needStack(t)
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.DemoToken)
	b.navigate("/ui/jobs/new?tenant=" + tenant)
	b.until("the submit form", hasTestID("submit-form"))
	id := "console-form-job"
	b.setField("id", id)
	b.setField("name", "submitted from the console")
	b.setField("resources.gpu.count", "1")
	b.do(chromedp.SetValue(field("resources.gpu.model"), "L4"))
	b.setField("run.duration", "3s")
	_ = eval[bool](b, "window.__sameDocument = true")
	b.do(chromedp.Click(chromedp.CSS(`[data-testid=submit-button]`)))
	b.until("the job's page", `location.pathname === `+jsString("/ui/jobs/"+tenant+"/"+id)+` && `+hasTestID("job-state"))
	b.untilWithin(2*waitFor, "succeeded on the job's page", `document.querySelector('[data-testid=job-state]').dataset.state === 'succeeded'`)
	types := eval[[]string](b, `[...document.querySelectorAll('[data-testid=timeline-event]')].map(e => e.dataset.type)`)
	for _, want := range []string{"queued", "scheduled", "running", "succeeded"} {
		if !containsString(types, want) {
			t.Errorf("the timeline lacks %s: %q", want, types)
		}
	}
	if !eval[bool](b, "window.__sameDocument === true") {
		t.Errorf("the page reloaded on the way to succeeded")
	}
	b.shot("job-succeeded")
	// The job went through the API for real.
	st, err := s.admin.Job(t.Context(), tenant, id)
	if err != nil || st.State != contracts.StateSucceeded || st.Request == nil || st.Request.Resources.GPU.Model != "L4" {
		t.Errorf("the API has %+v %v, want a succeeded L4 job", st, err)
	}
	b.navigate("/ui/jobs?tenant=" + tenant)
	row := fmt.Sprintf(`document.querySelector('[data-testid="job-row-%s"]')`, safeID(id))
	b.until("the job succeeded in the list", row+` && `+row+`.dataset.state === 'succeeded'`)
}

// TestJobPageWaitsForAJobNotYetQueued: the job page opened before its job
// is known (the submit form opens it on the submit's 202, before the
// scheduler has queued the job) says it is waiting, then shows the job
// once it is queued, without a reload.
func TestJobPageWaitsForAJobNotYetQueued(t *testing.T) {
	s := needStack(t)
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.DemoToken)
	id := "console-not-yet-queued"
	b.navigate("/ui/jobs/" + tenant + "/" + id)
	b.until("the page waiting for the job", hasTestID("job-waiting"))
	_ = eval[bool](b, "window.__sameDocument = true")
	if _, err := s.admin.Submit(t.Context(), tenant, contracts.JobRequest{ID: id,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "L4"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(time.Second)}}); err != nil {
		t.Fatal(err)
	}
	b.until("the job's page", hasTestID("job-state"))
	if !eval[bool](b, "window.__sameDocument === true") {
		t.Errorf("the page reloaded to show the job")
	}
}

// TestInvalidSubmitShowsTheFieldMessageOnce: a negative duration is
// refused by the API with a field error on run.duration; the form shows
// that message, word for word, exactly once in the page, beside the
// duration input (its aria-describedby), and submits nothing.
func TestInvalidSubmitShowsTheFieldMessageOnce(t *testing.T) {
	s := needStack(t)
	// The API's own words for this mistake.
	_, err := s.admin.SubmitJSON(t.Context(), tenant, []byte(`{"schemaVersion":1,"id":"console-invalid","resources":{"gpu":{"count":1}},"run":{"duration":"-1s"}}`))
	var apiErr *gpuplane.APIError
	if !errors.As(err, &apiErr) || apiErr.Field("run.duration") == nil {
		t.Fatalf("the API answered %v, want a field error on run.duration", err)
	}
	want := apiErr.Field("run.duration").Message

	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.DemoToken)
	b.navigate("/ui/jobs/new?tenant=" + tenant)
	b.until("the submit form", hasTestID("submit-form"))
	b.setField("id", "console-invalid")
	b.setField("run.duration", "-1s")
	b.do(chromedp.Click(chromedp.CSS(`[data-testid=submit-button]`)))
	b.until("the field's message", contains(want))
	text := b.text()
	if n := strings.Count(text, want); n != 1 {
		t.Errorf("the message %q shows %d times:\n%s", want, n, clip(text, 3000))
	}
	// Beside its input: the element with the message is the one the input
	// names as its description, inside the input's own field box.
	beside := eval[bool](b, fmt.Sprintf(`(() => {
		const input = document.querySelector('[data-testid="field-run.duration"]');
		const err = document.getElementById(input.getAttribute('aria-describedby') || '');
		return !!err && !err.hidden && err.textContent.includes(%s) && err.closest('.field') === input.closest('.field')
			&& input.getAttribute('aria-invalid') === 'true';
	})()`, jsString(want)))
	if !beside {
		b.fail("the message %q is not beside the duration input", want)
	}
	b.shot("submit-invalid")
	if _, err := s.admin.Job(t.Context(), tenant, "console-invalid"); err == nil {
		t.Errorf("the invalid job exists")
	}
}

// TestKeyboardReachesTheMainActions: from the top of a page, Tab alone
// reaches every view's link in the navigation, the tenant picker and
// sign-out; Enter on a link opens its view; on the jobs page Tab reaches
// "Submit a job", and in the form the submit button.
func TestKeyboardReachesTheMainActions(t *testing.T) {
	s := needStack(t)
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.AdminToken)
	b.navigate("/ui/fleet")
	b.until("the fleet page", hasTestID("fleet-pools"))
	reached := b.tabThrough(40)
	for _, want := range []string{"nav-fleet", "nav-queues", "nav-jobs", "nav-cost", "nav-ops", "tenant-picker", "logout"} {
		if !containsString(reached, want) {
			t.Errorf("Tab never reaches %s; it reaches %q", want, reached)
		}
	}
	// Enter on the focused Jobs link opens the jobs view.
	b.focusByTab("nav-jobs", 40)
	b.do(chromedp.KeyEvent(kb.Enter))
	b.until("the jobs view by keyboard", `location.pathname === '/ui/jobs' && `+hasTestID("jobs-table"))
	if r := b.tabThrough(60); !containsString(r, "new-job") {
		t.Errorf("Tab never reaches the submit link on the jobs page; it reaches %q", r)
	}
	b.navigate("/ui/jobs/new?tenant=" + tenant)
	b.until("the submit form", hasTestID("submit-form"))
	if r := b.tabThrough(80); !containsString(r, "submit-button") {
		t.Errorf("Tab never reaches the submit button; it reaches %q", r)
	}
}

// tabThrough presses Tab up to n times from the top of the document and
// lists the data-testid (or tag) of each element focused on the way.
func (b *tab) tabThrough(n int) []string {
	b.t.Helper()
	_ = eval[bool](b, "document.activeElement && document.activeElement.blur(), window.scrollTo(0, 0), true")
	var seen []string
	for range n {
		b.do(chromedp.KeyEvent(kb.Tab))
		seen = append(seen, eval[string](b, `(() => { const e = document.activeElement; return e ? (e.dataset.testid || e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')) : ''; })()`))
	}
	return seen
}

// focusByTab presses Tab from the top until the element with data-testid
// id has the focus.
func (b *tab) focusByTab(id string, n int) {
	b.t.Helper()
	_ = eval[bool](b, "document.activeElement && document.activeElement.blur(), true")
	for range n {
		b.do(chromedp.KeyEvent(kb.Tab))
		if eval[bool](b, fmt.Sprintf("(document.activeElement || {}).dataset?.testid === %s", jsString(id))) {
			return
		}
	}
	b.fail("Tab never focuses %s", id)
}

// TestJobsTableFitsWithALongPendingReason: at 1280 px the jobs table,
// with a job whose pending reason is long (the scheduler's message for a
// request no machine can meet) and a long name, fits the page: no column
// pushed off the side, the document does not scroll sideways.
func TestJobsTableFitsWithALongPendingReason(t *testing.T) {
	s := needStack(t)
	f := s.jobs(t)
	id := "console-long-reason"
	if _, err := s.admin.Submit(t.Context(), tenant, contracts.JobRequest{ID: id,
		Name:      strings.Repeat("a-very-long-job-name-", 6),
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 32, Model: "H100-80GB", Nodes: 4}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(time.Minute)}}); err != nil {
		t.Fatal(err)
	}
	var reason string
	eventually(t, id+"'s pending reason", func() (bool, string) {
		d, err := s.admin.DescribeJob(t.Context(), tenant, id)
		if err != nil || d.Pending == nil || d.Pending.Message == "" {
			return false, fmt.Sprint(err)
		}
		reason = d.Pending.Message
		return true, ""
	})
	t.Logf("pending reason (%d characters): %s; the fixture's: %s", len(reason), reason, f.pending.Pending.Message)
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.AdminToken)
	b.navigate("/ui/jobs?tenant=" + tenant)
	row := fmt.Sprintf(`document.querySelector('[data-testid="job-row-%s"]')`, safeID(id))
	b.until("the job in the table", row)
	b.noHorizontalScroll("jobs")
	// Every column of the row is within the viewport.
	out := eval[string](b, `(() => {
		const w = document.documentElement.clientWidth;
		return [...`+row+`.children].filter(c => c.getBoundingClientRect().right > w + 1 || c.getBoundingClientRect().width < 1)
			.map(c => c.className || c.tagName).join(', ');
	})()`)
	if out != "" {
		b.fail("columns off the page or squeezed to nothing at 1280 px: %s", out)
	}
	b.shot("jobs-long-reason")
}

func containsString(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
