package console

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// streamCounter wraps the page's fetch so the test can count the
// streams the console holds open: a response asked for as
// text/event-stream (the fleet, queues, jobs, job and ops streams) or
// text/plain (a followed log) counts from its headers until its body
// ends, errors, is cancelled or its request is aborted. window.__streams
// has open (now), max (since the test last set it) and opened (in all).
const streamCounter = `(() => {
	const s = window.__streams = { open: 0, max: 0, opened: 0 };
	const orig = window.fetch;
	window.fetch = async function (input, init) {
		const accept = new Headers((init && init.headers) || {}).get('Accept') || '';
		const res = await orig.apply(this, arguments);
		if (!/text\/event-stream|text\/plain/.test(accept) || !res.body || !res.ok) return res;
		s.open++; s.opened++; s.max = Math.max(s.max, s.open);
		let ended = false;
		const end = () => { if (!ended) { ended = true; s.open--; } };
		if (init && init.signal) {
			if (init.signal.aborted) end();
			else init.signal.addEventListener('abort', end, { once: true });
		}
		const reader = res.body.getReader();
		const body = new ReadableStream({
			async pull(c) {
				try {
					const { value, done } = await reader.read();
					if (done) { end(); c.close(); } else c.enqueue(value);
				} catch (e) { end(); c.error(e); }
			},
			cancel(why) { end(); return reader.cancel(why); },
		});
		return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
	};
})();`

// streamsNeeded is how many streams each view holds while shown: at
// least lo (the view is live) and never more than hi. The job page
// follows the running job's events and its log (a simulated job may
// have no log to follow).
var streamsNeeded = map[string][2]int{
	"fleet": {1, 1}, "node": {1, 1}, "queues": {1, 1}, "jobs": {1, 1},
	"job": {1, 2}, "submit": {0, 0}, "cost": {0, 0}, "ops": {1, 1},
}

// clickLink follows path as a link of the app would: a click on an
// in-app anchor, which the console routes through history, no page load.
func (b *tab) clickLink(path string) {
	b.t.Helper()
	_ = eval[bool](b, fmt.Sprintf(`(() => {
		const a = document.createElement('a');
		a.href = %s;
		document.body.append(a);
		a.click();
		a.remove();
		return true;
	})()`, jsString(path)))
}

// TestNavigationFreesStreams goes, in ONE tab, through every view twice,
// each both by a link inside the app and by a full page load. Before the
// fix the streams of views already left kept their connections (a
// fetch-based stream is not ended by leaving the view or the document),
// so after five loads the sixth waited about a minute for one of
// Chromium's six connections per host. Now each view holds only the
// streams it needs while shown (counted by a wrapped fetch), and after
// all of it a view still renders within a short bound.
func TestNavigationFreesStreams(t *testing.T) {
	s := needStack(t)
	f := s.jobs(t)
	b := s.open(t, desktopWidth, 900)
	b.addScript(streamCounter)
	b.login(s.ep.AdminToken)
	views := s.pages(t, f)
	// The bound of one view: a stalled connection waits about 60 s.
	const bound = 20 * time.Second
	// check waits for view p, moved to at start, to show its data and
	// hold its streams; the load or move and the data together within
	// bound.
	check := func(p view, how string, start time.Time) {
		t.Helper()
		need, ok := streamsNeeded[p.name]
		if !ok {
			t.Fatalf("no stream count for view %s", p.name)
		}
		b.untilWithinAll(bound, fmt.Sprintf("%s (%s)", p.name, how), p.ready...)
		// The view's streams open after its data shows: wait until it
		// holds as many as it needs, then none may be left over.
		b.untilWithin(bound, fmt.Sprintf("%s (%s) opens its streams", p.name, how),
			fmt.Sprintf("window.__streams && window.__streams.open >= %d && window.__streams.open <= %d", need[0], need[1]))
		got := eval[[]int](b, "[window.__streams.open, window.__streams.max]")
		if got[0] > need[1] || got[1] > need[1] {
			t.Errorf("%s (%s): %d streams open, %d at most since the move; the view needs %d at most", p.name, how, got[0], got[1], need[1])
		}
		took := time.Since(start)
		t.Logf("%s (%s): shown in %s, %d streams open", p.name, how, took.Round(time.Millisecond), got[0])
		if took > bound {
			// A stalled connection: the page load itself waited.
			b.fail("%s (%s) took %s to show, over %s: a connection was held by a stream of a view left", p.name, how, took.Round(time.Millisecond), bound)
		}
	}
	for round := range 2 {
		for _, p := range views {
			// A full page load: a new document, whose counter starts at 0.
			start := time.Now()
			b.navigate(p.path)
			check(p, fmt.Sprintf("load %d", round+1), start)
			// Then away and back by links inside the app: the streams of
			// the view left end before the next view's open.
			other := views[(indexOf(views, p.name)+1)%len(views)]
			// max counts from 0 the streams opened from here: one of the
			// view left still open when the next opens makes it exceed.
			_ = eval[bool](b, "(window.__streams.max = 0, true)")
			start = time.Now()
			b.clickLink(other.path)
			check(other, fmt.Sprintf("link %d", round+1), start)
			_ = eval[bool](b, "(window.__streams.max = 0, true)")
			start = time.Now()
			b.clickLink(p.path)
			check(p, fmt.Sprintf("link back %d", round+1), start)
		}
	}
	// After some thirty views in one tab, a view that streams still
	// renders within the bound, by a load and by a link.
	start := time.Now()
	b.navigate(views[0].path)
	check(views[0], "last load", start)
	if opened := eval[int](b, "window.__streams.opened"); opened < 1 {
		t.Errorf("the counter saw no stream on the fleet page: %d", opened)
	}
}

func indexOf(vs []view, name string) int {
	for i, v := range vs {
		if v.name == name {
			return i
		}
	}
	return 0
}

// untilWithinAll is untilAll within d.
func (b *tab) untilWithinAll(d time.Duration, what string, checks ...string) {
	b.t.Helper()
	js := "[" + strings.Join(func() []string {
		var out []string
		for _, c := range checks {
			out = append(out, "(() => { try { return !!("+c+"); } catch (e) { return false; } })()")
		}
		return out
	}(), ", ") + "].every(Boolean)"
	b.untilWithin(d, what, js)
}

// visible is a JavaScript test that the element of data-testid id is
// shown (present, not hidden, laid out).
func visible(id string) string {
	return fmt.Sprintf("(e => !!e && !e.hidden && getComputedStyle(e).display !== 'none' && e.offsetParent !== null)(document.querySelector('[data-testid=%s]'))", jsString(id))
}

// TestNavigationJobActionsFollowState: a job's page offers the actions
// its state allows. A succeeded job offered Cancel and Checkpoint; now
// it offers Resubmit alone, a waiting job Cancel without Checkpoint,
// and the running checkpointable job both.
func TestNavigationJobActionsFollowState(t *testing.T) {
	s := needStack(t)
	s.jobs(t)
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.AdminToken)
	for _, c := range []struct {
		job, state         string
		cancel, checkpoint bool
	}{
		{shortJob, "succeeded", false, false},
		{pendingJob, "queued", true, false},
		{longJob, "running", true, true},
	} {
		b.navigate("/ui/jobs/" + tenant + "/" + c.job)
		b.until(c.job+"'s page", fmt.Sprintf(`(document.querySelector('[data-testid=job-state]') || {}).dataset?.state === %s && %s`,
			jsString(c.state), visible("job-resubmit")))
		got := eval[[]bool](b, "["+visible("job-cancel")+", "+visible("job-checkpoint")+"]")
		if got[0] != c.cancel || got[1] != c.checkpoint {
			t.Errorf("%s (%s): cancel shown %v, checkpoint shown %v; want %v, %v", c.job, c.state, got[0], got[1], c.cancel, c.checkpoint)
		}
		b.shot("job-actions-" + c.state)
	}
}

// TestNavigationJobsListLoadMore: the jobs list offers "Load more" only
// when the API has a next page. A page the tenant's jobs fill exactly
// ("5 of 5 jobs shown") offered it, and it loaded nothing; now a page
// asks for one job more than it shows. ?limit= sets the page size.
func TestNavigationJobsListLoadMore(t *testing.T) {
	s := needStack(t)
	s.jobs(t)
	all, err := s.admin.ListJobs(t.Context(), tenant, gpuplane.ListOptions{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	n := len(all.Jobs)
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.AdminToken)
	rows := `document.querySelectorAll('[data-testid^="job-row-"]').length`
	// Every job on the first page, the page full: nothing more to load.
	b.navigate(fmt.Sprintf("/ui/jobs?tenant=%s&limit=%d", tenant, n))
	b.until(fmt.Sprintf("all %d jobs", n), fmt.Sprintf("%s === %d && %s", rows, n, hasTestID("jobs-more")))
	if eval[bool](b, visible("jobs-more")) {
		t.Errorf("Load more shows under all %d jobs on a page of %d: %q", n, n, b.mainText())
	}
	// A page short of one: Load more, which brings the last and goes.
	b.navigate(fmt.Sprintf("/ui/jobs?tenant=%s&limit=%d", tenant, n-1))
	b.until("a page of one job less, with Load more", fmt.Sprintf("%s === %d && %s", rows, n-1, visible("jobs-more")))
	b.do(chromedp.Click(chromedp.CSS(`[data-testid=jobs-more]`)))
	b.until("the last job loaded, Load more gone", fmt.Sprintf("%s === %d && !(%s)", rows, n, visible("jobs-more")))
}

// TestNavigationCostUnits: the cost page shows a short usage in a unit
// that fits it (not 0.00 GPU hours), a chart whose time axis spans its
// data (not years out), and never a currency of nothing ("()").
func TestNavigationCostUnits(t *testing.T) {
	s := needStack(t)
	s.jobs(t)
	b := s.open(t, desktopWidth, 900)
	b.login(s.ep.AdminToken)
	b.navigate("/ui/cost?tenant=" + tenant)
	b.untilAll("the cost page", hasTestID("cost-gpu-hours"), `document.querySelector('[data-testid=cost-chart-gpu-pool] canvas')`)
	tile := eval[string](b, `document.querySelector('[data-testid=cost-gpu-hours] .big').textContent`)
	num, unit, _ := strings.Cut(tile, " ")
	if v, err := strconv.ParseFloat(num, 64); err != nil || v <= 0 || !strings.HasPrefix(unit, "GPU-") {
		t.Errorf("GPU time tile %q: want a positive amount with its unit (GPU-s, GPU-min, GPU-h)", tile)
	}
	span := eval[[]float64](b, `(f => [Number(f.dataset.xMin), Number(f.dataset.xMax)])(document.querySelector('[data-testid=cost-chart-gpu-pool]'))`)
	now := float64(time.Now().Unix())
	// The usage is from the last minutes; the axis may run a step (a day
	// at most) either side of it.
	if span[0] < now-3*86400 || span[1] > now+2*86400 || span[1] <= span[0] {
		t.Errorf("the GPU time chart spans %s to %s, want around now (%s)",
			time.Unix(int64(span[0]), 0).UTC(), time.Unix(int64(span[1]), 0).UTC(), time.Unix(int64(now), 0).UTC())
	}
	text := b.mainText()
	for _, bad := range []string{"()", "( )", "undefined", "NaN", " 0.00 GPU"} {
		if strings.Contains(text, bad) {
			t.Errorf("the cost page shows %q:\n%s", bad, text)
		}
	}
	if n := strings.Count(text, "No price book set") + strings.Count(text, "not yet priced"); n > 1 {
		t.Errorf("the cost page says %d times that usage is not priced, want once at most:\n%s", n, text)
	}
	b.shot("cost-units")
}
