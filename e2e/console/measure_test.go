package console

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// transfer tallies what the browser fetched, per request, from the
// DevTools network events: the bytes on the wire (headers and compressed
// bodies) and the bodies as decoded.
type transfer struct {
	mu   sync.Mutex
	reqs map[network.RequestID]*fetched
}

type fetched struct {
	url, mime, encoding string
	kind                network.ResourceType
	wire, decoded       int64
	done                bool
}

func (tr *transfer) on(ev any) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	get := func(id network.RequestID) *fetched {
		f := tr.reqs[id]
		if f == nil {
			f = &fetched{}
			tr.reqs[id] = f
		}
		return f
	}
	switch e := ev.(type) {
	case *network.EventResponseReceived:
		f := get(e.RequestID)
		f.kind = e.Type
		if e.Response != nil {
			f.url, f.mime = e.Response.URL, e.Response.MimeType
			if v, ok := e.Response.Headers["Content-Encoding"]; ok {
				f.encoding = fmt.Sprint(v)
			} else if v, ok := e.Response.Headers["content-encoding"]; ok {
				f.encoding = fmt.Sprint(v)
			}
		}
	case *network.EventDataReceived:
		f := get(e.RequestID)
		f.decoded += e.DataLength
		if !f.done {
			f.wire += e.EncodedDataLength
		}
	case *network.EventLoadingFinished:
		f := get(e.RequestID)
		// The total, headers included, replaces the chunks' sum.
		f.wire, f.done = int64(e.EncodedDataLength), true
	}
}

// recordTransfers enables the network domain of the tab (cache off: a
// cold load) and tallies every request from now on.
func (b *tab) recordTransfers() *transfer {
	b.t.Helper()
	tr := &transfer{reqs: map[network.RequestID]*fetched{}}
	if err := chromedp.Listen(b.ctx, tr.on); err != nil {
		b.t.Fatal(err)
	}
	b.do(chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		if _, err := cdp.Call(ctx, t, network.Enable, network.EnableParams{}); err != nil {
			return err
		}
		_, err := cdp.Call(ctx, t, network.SetCacheDisabled, network.SetCacheDisabledParams{CacheDisabled: true})
		return err
	}))
	return tr
}

// pageWeight is what a page load cost, by kind of request.
type pageWeight struct {
	wire, decoded int64
	lines         []string
}

func (tr *transfer) weight() pageWeight {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var w pageWeight
	for _, f := range tr.reqs {
		if f.url == "" {
			continue
		}
		w.wire += f.wire
		w.decoded += f.decoded
		state := ""
		if !f.done {
			state = " (streaming, so far)"
		}
		enc := f.encoding
		if enc == "" {
			enc = "identity"
		}
		w.lines = append(w.lines, fmt.Sprintf("%9d B wire %9d B decoded  %-10s %-8s %s%s", f.wire, f.decoded, f.kind, enc, trimOrigin(f.url), state))
	}
	sort.Strings(w.lines)
	return w
}

func trimOrigin(u string) string {
	if i := strings.Index(u, "://"); i >= 0 {
		if j := strings.IndexByte(u[i+3:], '/'); j >= 0 {
			return u[i+3+j:]
		}
	}
	return u
}

// render is the timing of one load of the fleet page, from the page's
// Performance API: navigation start to first contentful paint, and to the
// moment every machine's card was in the document.
type render struct {
	FCP   float64 `json:"fcp"`
	Cards float64 `json:"cards"`
	N     int     `json:"n"`
}

// timeCards records, in every document of the tab, when the fleet's
// cards first number window.__wantCards (set through sessionStorage, as
// it must be there before the app's scripts run).
const timeCards = `
(() => {
  const want = +sessionStorage.getItem('gpuplane.test.wantCards') || 0;
  if (!want) return;
  const tick = () => {
    const root = document.querySelector('[data-testid=fleet-pools]');
    const n = root ? root.getElementsByTagName('article').length : 0;
    if (n >= want) { window.__cardsAt = performance.now(); window.__cardsN = n; return; }
    requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
})();
`

// loadFleetPage loads /ui/fleet cold in a logged-in tab and answers its
// weight and timings once all machines machines are drawn.
func (b *tab) loadFleetPage(machines int) (pageWeight, render) {
	b.t.Helper()
	_ = eval[bool](b, fmt.Sprintf("sessionStorage.setItem('gpuplane.test.wantCards', '%d'), true", machines))
	// A tab behind another paints nothing, so it records no first paint:
	// the tab measured is brought to the front (other tests' tabs may
	// still be open in the same browser).
	if _, err := chromedp.Call(b.ctx, page.BringToFront, cdp.Empty{}); err != nil {
		b.t.Fatalf("bring the tab to the front: %v", err)
	}
	tr := b.recordTransfers()
	b.navigate("/ui/fleet")
	b.untilWithin(10*time.Minute, fmt.Sprintf("%d machines drawn", machines), "window.__cardsAt")
	b.untilWithin(time.Minute, "the first contentful paint recorded",
		"performance.getEntriesByName('first-contentful-paint').length > 0")
	r := eval[render](b, `({fcp: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || -1,
		cards: window.__cardsAt, n: window.__cardsN})`)
	return tr.weight(), r
}

// gzipSize is how many bytes the gateway's answer to path would be
// gzipped (-6), the weight the page would have behind a compressing
// proxy. For an event stream, the body up to the end of its first event
// (the snapshot).
func (s *stack) gzipSize(t testing.TB, path, token string) (raw, gz int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.ep.GatewayURL+path, nil)
	req.Header.Set("Authorization", "Bearer "+token)
	if strings.Contains(path, "/events") {
		req.Header.Set("Accept", "text/event-stream")
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var body []byte
	if strings.HasPrefix(res.Header.Get("Content-Type"), "text/event-stream") {
		rd := bufio.NewReaderSize(res.Body, 1<<20)
		var buf bytes.Buffer
		for {
			line, err := rd.ReadBytes('\n')
			buf.Write(line)
			if err != nil || (len(bytes.TrimSpace(line)) == 0 && bytes.Contains(buf.Bytes(), []byte("data:"))) {
				break
			}
		}
		body = buf.Bytes()
	} else if body, err = io.ReadAll(res.Body); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	_, _ = zw.Write(body)
	_ = zw.Close()
	return len(body), out.Len()
}

// TestFleetPageWeightAndFirstRender loads the fleet page cold and logs
// its weight (bytes on the wire per request, and gzipped) and time to
// first render (navigation start to first contentful paint, and to every
// machine's card drawn), for the make-run fleet; the large fleet is
// BenchmarkFleetPageLarge.
func TestFleetPageWeightAndFirstRender(t *testing.T) {
	s := needStack(t)
	b := s.open(t, desktopWidth, 900)
	b.addScript(timeCards)
	b.login(s.ep.AdminToken)
	w, r := b.loadFleetPage(len(s.machineIDs()))
	t.Logf("fleet page, %d machines: %d B on the wire (%d B decoded), first contentful paint %.0f ms, all cards %.0f ms after navigation start\n%s",
		r.N, w.wire, w.decoded, r.FCP, r.Cards, strings.Join(w.lines, "\n"))
	s.logGzipped(t, b)
	if r.FCP <= 0 || r.Cards <= 0 || w.wire <= 0 {
		t.Errorf("no figures: %+v, %d B", r, w.wire)
	}
}

// logGzipped logs what the page's static assets and its fleet snapshot
// weigh gzipped.
func (s *stack) logGzipped(t testing.TB, b *tab) {
	assets := eval[[]string](b, `[...performance.getEntriesByType('resource').map(e => new URL(e.name).pathname).filter(p => p.startsWith('/ui/assets/')), location.pathname]`)
	total := 0
	for _, p := range append(assets, "/v1/fleet/events") {
		raw, gz := s.gzipSize(t, p, s.ep.AdminToken)
		total += gz
		t.Logf("gzipped: %9d B (%9d B raw) %s", gz, raw, p)
	}
	t.Logf("gzipped: %9d B in all (the page, its assets and the fleet snapshot)", total)
}
