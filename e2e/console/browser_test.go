package console

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// The viewports every page is looked at: a laptop and a phone.
const (
	desktopWidth = 1280
	phoneWidth   = 390
)

// tab is one browser tab of a test, logged in or not.
type tab struct {
	t     testing.TB
	s     *stack
	ctx   context.Context
	width int
	// close closes the tab (and ends its requests).
	close func()
}

// open opens a tab of width × height CSS pixels (a phone's with touch
// and a mobile viewport), closed when t ends.
func (s *stack) open(t testing.TB, width, height int) *tab {
	t.Helper()
	ctx, cancel := context.WithTimeout(s.browser, 4*waitFor)
	ctx, cancelTab := chromedp.NewContext(ctx)
	t.Cleanup(func() { cancelTab(); cancel() })
	b := &tab{t: t, s: s, ctx: ctx, width: width, close: func() { cancelTab(); cancel() }}
	var opts []chromedp.EmulateViewportOption
	if width <= phoneWidth {
		opts = append(opts, chromedp.EmulateMobile, chromedp.EmulateTouch, chromedp.EmulatePortrait)
	}
	b.do(chromedp.EmulateViewport(int64(width), int64(height), opts...))
	// Every uncaught error of the page's scripts is kept, and a test whose
	// pages threw fails at its end: a console that half works is a defect
	// the assertions on its text may not see.
	b.addScript(`window.__gpuplaneErrors = [];
addEventListener('error', e => window.__gpuplaneErrors.push(String(e.message || e.type) + ' at ' + (e.filename || '') + ':' + (e.lineno || '')));
addEventListener('unhandledrejection', e => window.__gpuplaneErrors.push('unhandled rejection: ' + String(e.reason && (e.reason.stack || e.reason))));`)
	t.Cleanup(func() {
		if t.Failed() {
			return
		}
		errs, err := evalErr[[]string](b, "window.__gpuplaneErrors || []")
		if err == nil && len(errs) > 0 {
			t.Errorf("the page's scripts threw: %q", errs)
		}
	})
	return b
}

// do runs actions in the tab, failing the test on an error.
func (b *tab) do(actions ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	if err := chromedp.Do(b.ctx, actions...); err != nil {
		b.fail("browser: %v", err)
	}
}

// eval evaluates a JavaScript expression in the page into T (a promise
// is awaited).
func eval[T any](b *tab, js string) T {
	b.t.Helper()
	v, err := chromedp.Run(b.ctx, chromedp.Evaluate[T](js, chromedp.EvalAwaitPromise))
	if err != nil {
		b.fail("evaluate %s: %v", firstLine(js), err)
	}
	return v
}

// evalErr is eval that answers the error (a page that is reloading).
func evalErr[T any](b *tab, js string) (T, error) {
	return chromedp.Run(b.ctx, chromedp.Evaluate[T](js, chromedp.EvalAwaitPromise))
}

// until waits, bounded by waitFor, for the JavaScript expression js to be
// truthy in the page; on failure it says what the page showed.
func (b *tab) until(what, js string) {
	b.t.Helper()
	b.untilWithin(waitFor, what, js)
}

func (b *tab) untilWithin(d time.Duration, what, js string) {
	b.t.Helper()
	var last error
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		ok, err := evalErr[bool](b, "!!("+js+")")
		if err == nil && ok {
			return
		}
		last = err
	}
	b.fail("%s: not within %s (last error %v)", what, d, last)
}

// untilAll waits, bounded by waitFor, until every JavaScript test of
// checks is truthy at once; on failure it names those that were not.
func (b *tab) untilAll(what string, checks ...string) {
	b.t.Helper()
	js := "[" + strings.Join(func() []string {
		var out []string
		for _, c := range checks {
			out = append(out, "(() => { try { return !!("+c+"); } catch (e) { return false; } })()")
		}
		return out
	}(), ", ") + "]"
	var last []bool
	for deadline := time.Now().Add(waitFor); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		oks, err := evalErr[[]bool](b, js)
		if err != nil {
			continue
		}
		last = oks
		if !slices.Contains(oks, false) {
			return
		}
	}
	var failed []string
	for i, ok := range last {
		if !ok {
			failed = append(failed, clip(checks[i], 300))
		}
	}
	b.fail("%s: not within %s; still false:\n%s", what, waitFor, strings.Join(failed, "\n"))
}

// fail ends the test with msg, what the page showed and a screenshot.
func (b *tab) fail(format string, args ...any) {
	b.t.Helper()
	msg := fmt.Sprintf(format, args...)
	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	loc, _ := chromedp.Run(ctx, chromedp.Location())
	text, _ := chromedp.Run(ctx, chromedp.Evaluate[string]("document.body ? document.body.innerText : ''"))
	if png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot()); err == nil {
		path := filepath.Join(shotsDir(b.t), "FAILED-"+safeName(b.t.Name())+".png")
		if os.WriteFile(path, png, 0o644) == nil {
			msg += "\nscreenshot: " + path
		}
	}
	b.t.Fatalf("%s\nat %s, the page shows:\n%s", msg, loc, clip(text, 3000))
}

// navigate loads path of the gateway and waits for the page's load event.
func (b *tab) navigate(path string) {
	b.t.Helper()
	b.do(chromedp.Navigate(b.s.ep.GatewayURL + path))
}

// text is the page's visible text.
func (b *tab) text() string {
	b.t.Helper()
	return eval[string](b, "document.body ? document.body.innerText : ''")
}

// shot writes a screenshot of the whole page, named by page and width.
func (b *tab) shot(page string) {
	b.t.Helper()
	// A frame after the last change, so the picture shows what is drawn.
	_ = eval[bool](b, "new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))")
	png, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100))
	if err != nil {
		// A page taller than the browser can draw at once (2,000
		// machines): what the viewport shows.
		png, err = chromedp.Run(b.ctx, chromedp.CaptureScreenshot())
	}
	if err != nil {
		b.fail("screenshot of %s: %v", page, err)
	}
	path := filepath.Join(shotsDir(b.t), fmt.Sprintf("%s-%d.png", page, b.width))
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatal(err)
	}
	b.t.Logf("screenshot %s", path)
}

// testIDs lists the data-testid values present in the page (what a
// failure message names, to make selectors easy to fix).
func (b *tab) testIDs() []string {
	return eval[[]string](b, `[...new Set([...document.querySelectorAll('[data-testid]')].map(e => e.dataset.testid))]`)
}

// addScript runs js in every document the tab loads from now on, before
// the page's own scripts.
func (b *tab) addScript(js string) {
	b.t.Helper()
	b.do(chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		_, err := cdp.Call(ctx, t, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: js})
		return err
	}))
}

var shotsOnce = map[string]string{}

// shotsDir is GPUPLANE_CONSOLE_SHOTS (created), else a temporary
// directory of the test, named in the log.
func shotsDir(t testing.TB) string {
	t.Helper()
	if d := os.Getenv(envShots); d != "" {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	root := strings.SplitN(t.Name(), "/", 2)[0]
	if d, ok := shotsOnce[root]; ok {
		if _, err := os.Stat(d); err == nil {
			return d
		}
	}
	d := t.TempDir()
	shotsOnce[root] = d
	t.Logf("screenshots in %s (removed after the test; set %s to keep them)", d, envShots)
	return d
}

// jsString quotes s as a JavaScript string literal.
func jsString(s string) string {
	q, _ := json.Marshal(s)
	return string(q)
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i] + " …"
	}
	return s
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n] + " …"
	}
	return s
}

var unsafeChars = regexp.MustCompile(`[^A-Za-z0-9._-]+`)

func safeName(s string) string { return unsafeChars.ReplaceAllString(s, "_") }
