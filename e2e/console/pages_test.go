package console

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/gpuplane/gpuplane/contracts"
)

// machineIDs is every machine of the stack's static fleet.
func (s *stack) machineIDs() []string {
	var ids []string
	for _, m := range s.ep.Fleet.Machines() {
		ids = append(ids, m.NodeID)
	}
	return ids
}

// gpuCount is how many GPUs the static fleet has.
func (s *stack) gpuCount() int {
	n := 0
	for _, m := range s.ep.Fleet.Machines() {
		n += m.GPUCount
	}
	return n
}

// view is one view of the console and what shows that it renders the
// platform's real data.
type view struct {
	name string // the screenshots' name
	path string
	// ready are JavaScript tests that the view shows its data.
	ready []string
}

// pages are the console's views, each with the data the fixture and the
// stack put there.
func (s *stack) pages(t *testing.T, f fixture) []view {
	ids := s.machineIDs()
	// The scheduler's words, up to what changes from cycle to cycle (how
	// many jobs are ahead).
	pendingText, _, _ := strings.Cut(f.pending.Pending.Message, ";")
	return []view{
		// Every machine of the fleet, every GPU drawn, and the GPU the
		// long job runs on with its owner.
		{"fleet", "/ui/fleet", append(containsEach(ids...),
			fmt.Sprintf(`document.querySelectorAll('main li.gpu[data-testid^="gpu-"]').length >= %d`, s.gpuCount()),
			fmt.Sprintf(`[...document.querySelectorAll('main li.gpu')].some(g => (g.dataset.owner || '').includes(%s))`, jsString(tenant+"/"+longJob)))},
		// The machine the long job runs on, with that job among its runs.
		{"node", "/ui/fleet/nodes/" + f.long.Placement.NodeID, []string{contains(f.long.Placement.NodeID, longJob)}},
		// The job waiting for a machine that does not exist, with the
		// scheduler's own words.
		{"queues", "/ui/queues", []string{fmt.Sprintf(`document.querySelector('[data-testid="waiting-%s"] a[href$="/%s"]')`, safeID(pendingJob), pendingJob),
			contains(string(f.pending.Pending.Reason), pendingText)}},
		{"jobs", "/ui/jobs?tenant=" + tenant, []string{contains(longJob, pendingJob, shortJob)}},
		{"job", "/ui/jobs/" + tenant + "/" + longJob, []string{contains(longJob, string(contracts.StateRunning), f.long.Placement.NodeID)}},
		{"submit", "/ui/jobs/new?tenant=" + tenant, []string{hasTestID("submit-form")}},
		// The tenant's usage records (charts, not "no usage"), and the
		// invoice's line for the H100 pool the jobs ran in.
		{"cost", "/ui/cost?tenant=" + tenant, []string{hasTestID("cost-tenant"), "!" + hasTestID("cost-empty"),
			`document.querySelector('figure.chart canvas')`,
			`[...document.querySelectorAll('[data-testid=invoice] tbody tr')].some(r => r.innerText.includes('h100') && r.innerText.includes('H100-80GB'))`}},
		// The autoscaler's decisions for the spot pool it keeps at one
		// machine at least.
		{"ops", "/ui/ops", []string{`[...document.querySelectorAll('[data-testid=ops-event]')].some(e => e.innerText.includes('l4-spot'))`}},
	}
}

// TestPagesRenderRealData opens every view as the platform admin at 1280
// and 390 px and waits for the stack's data on it: the fleet's machines
// and GPUs with their owners, the pending job with the scheduler's
// reason, the jobs, the tenant's usage, the autoscaler's events. Each is
// written as a screenshot.
func TestPagesRenderRealData(t *testing.T) {
	s := needStack(t)
	f := s.jobs(t)
	for _, width := range []int{desktopWidth, phoneWidth} {
		t.Run(fmt.Sprint(width), func(t *testing.T) {
			for _, p := range s.pages(t, f) {
				// A tab per view: in one tab, after five full page loads of
				// views that stream (fleet, machine, jobs, job), the next
				// load waits about 60 s for a connection (Chromium's six
				// per host over HTTP/1.1 stay held by the streams of pages
				// already left); closing the tab frees them.
				b := s.open(t, width, 900)
				b.login(s.ep.AdminToken)
				start := time.Now()
				b.navigate(p.path)
				b.untilAll(p.name+" shows the platform's data", p.ready...)
				t.Logf("%s shows its data %s after the navigation", p.name, time.Since(start).Round(time.Millisecond))
				b.noHorizontalScroll(p.name)
				b.shot(p.name)
				b.close()
			}
		})
	}
}

// noHorizontalScroll fails when the page is wider than the viewport: a
// view must fit its width (tables scroll inside their own box).
func (b *tab) noHorizontalScroll(page string) {
	b.t.Helper()
	over := eval[string](b, `(() => {
		const d = document.documentElement;
		if (d.scrollWidth <= d.clientWidth + 1) return '';
		const wide = [...document.querySelectorAll('main *')].filter(e => e.getBoundingClientRect().right > d.clientWidth + 1)
			.slice(0, 5).map(e => e.tagName.toLowerCase() + (e.dataset.testid ? '[' + e.dataset.testid + ']' : '') + (e.className ? '.' + String(e.className).split(' ').join('.') : ''));
		return d.scrollWidth + ' px wide in ' + d.clientWidth + ': ' + wide.join(', ');
	})()`)
	if over != "" {
		b.fail("%s at %d px scrolls sideways: %s", page, b.width, over)
	}
}

// TestDeepLinksSurviveAReload opens each view by its URL in a fresh tab,
// reloads it, and finds the same view with the same data at the same URL.
func TestDeepLinksSurviveAReload(t *testing.T) {
	s := needStack(t)
	f := s.jobs(t)
	for _, p := range s.pages(t, f) {
		// A tab per view, as in TestPagesRenderRealData.
		b := s.open(t, desktopWidth, 900)
		b.login(s.ep.AdminToken)
		b.navigate(p.path)
		b.untilAll(p.name+" before the reload", p.ready...)
		before := eval[string](b, "location.pathname + location.search")
		b.do(chromedp.Reload())
		b.untilAll(p.name+" after the reload", p.ready...)
		if after := eval[string](b, "location.pathname + location.search"); after != before {
			t.Errorf("%s: the reload moved from %s to %s", p.name, before, after)
		}
		b.close()
	}
}

// hasTestID is a JavaScript test for an element with data-testid id.
func hasTestID(id string) string {
	return fmt.Sprintf("document.querySelector('[data-testid=%s]')", jsString(id))
}

// containsEach is a contains test per word.
func containsEach(words ...string) []string {
	var out []string
	for _, w := range words {
		out = append(out, contains(w))
	}
	return out
}

// TestATenantSeesOnlyItsTenants: the demo user, a member of acme only,
// finds acme alone in the tenant picker, acme's jobs and not another
// tenant's, and the operations view refused as a platform admin's.
func TestATenantSeesOnlyItsTenants(t *testing.T) {
	s := needStack(t)
	s.jobs(t)
	other := contracts.JobRequest{ID: "console-other-tenant", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}},
		Run: contracts.RunSpec{Duration: contracts.Duration(time.Second)}}
	if _, err := s.admin.Submit(t.Context(), "globex", other); err != nil {
		t.Fatal(err)
	}
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.DemoToken)
	b.navigate("/ui/jobs")
	b.untilAll("acme's jobs", contains(longJob), hasTestID("tenant-picker"))
	if opts := eval[[]string](b, `[...document.querySelectorAll('[data-testid=tenant-picker] option')].map(o => o.value)`); len(opts) != 1 || opts[0] != tenant {
		t.Errorf("the tenant picker offers %q, want only %s", opts, tenant)
	}
	if strings.Contains(b.mainText(), other.ID) {
		t.Errorf("globex's job shows to a member of acme")
	}
	b.navigate("/ui/ops")
	b.until("operations refused", `(document.querySelector('[data-testid=ops-live]') || {}).dataset?.state === 'forbidden'`)
	b.shot("ops-as-tenant")
}

// mainText is the main view's text.
func (b *tab) mainText() string {
	return eval[string](b, "(document.querySelector('main') || document.body).innerText")
}
