package console

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// BenchmarkFleetPageLarge measures the fleet page on the fleet
// simulator's large fleet (deploy/fleet/large.yaml: 2,000 machines of 8
// GPUs) running 10,000 jobs (one H100 each, across ten tenants: 6,400
// run, the rest wait), on the whole platform: the page's weight on the
// wire and gzipped, the time from navigation start to first contentful
// paint and to every machine's card drawn, and the DOM mutations a node
// event causes once it is drawn (a node event must rebuild one card, not
// the fleet). make bench runs it (-v: its per-request figures); it needs
// chromium. On the 2-core development machine (shared, load about 5):
// platform up in 4-8 s, 10,000 jobs submitted in about a minute, 6,392
// running; the page 1.4-1.9 MB on the wire (gzip), 8-11 MB decoded, the
// snapshot alone 5.8 MB raw / 767 kB gzipped; first contentful paint
// 156-160 ms, all 2,000 cards 2.8-4.9 s after navigation start; each
// node event (about 300 a second at this size) rebuilt one card, one
// mutation record, the other cards untouched.
func BenchmarkFleetPageLarge(b *testing.B) {
	if noBrowser != "" {
		b.Skip(noBrowser)
	}
	fl, err := fleet.Load(filepath.Join("..", "..", "deploy", "fleet", "large.yaml"))
	if err != nil {
		b.Skipf("no large fleet description here (module built alone?): %v", err)
	}
	machines := len(fl.Machines())
	start := time.Now()
	s, stop, err := startStack(context.Background(), fl, false, chromium)
	if err != nil {
		b.Fatal(err)
	}
	defer stop()
	b.Logf("platform with %d machines up in %s", machines, time.Since(start).Round(time.Millisecond))
	submitted := submitMany(b, s, 10000, 10)
	b.Logf("%d jobs submitted", submitted)

	for range b.N {
		measureLarge(b, s, machines)
	}
}

// submitMany submits n one-H100 jobs of an hour spread over tenants
// tenants (the gateway's rate limit is per tenant), 16 at a time, and
// waits until the gateway lists them all.
func submitMany(b *testing.B, s *stack, n, tenants int) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var next, done atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				tn := fmt.Sprintf("team-%02d", i%int64(tenants))
				_, err := s.admin.Submit(ctx, tn, contracts.JobRequest{ID: fmt.Sprintf("load-%05d", i),
					Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB"}},
					Run:       contracts.RunSpec{Duration: contracts.Duration(time.Hour)}})
				if err != nil {
					select {
					case errs <- fmt.Errorf("submit %d: %w", i, err):
					default:
					}
					return
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
	// Listed: the last job of each tenant is in the gateway's read model.
	if err := poll(ctx, "the jobs listed", func() (bool, string) {
		for i := n - tenants; i < n; i++ {
			if _, err := s.admin.Job(ctx, fmt.Sprintf("team-%02d", i%tenants), fmt.Sprintf("load-%05d", i)); err != nil {
				return false, err.Error()
			}
		}
		return true, ""
	}); err != nil {
		b.Fatal(err)
	}
	return int(done.Load())
}

func measureLarge(b *testing.B, s *stack, machines int) {
	t := s.open(b, desktopWidth, 900)
	t.addScript(timeCards + countFleetEvents)
	t.login(s.ep.AdminToken)
	w, r := t.loadFleetPage(machines)
	b.Logf("fleet page, %d machines: %d B on the wire (%d B decoded), first contentful paint %.0f ms, all cards %.0f ms after navigation start\n%s",
		r.N, w.wire, w.decoded, r.FCP, r.Cards, strings.Join(w.lines, "\n"))
	s.logGzipped(b, t)
	b.ReportMetric(float64(w.wire), "wire_B")
	b.ReportMetric(r.FCP, "fcp_ms")
	b.ReportMetric(r.Cards, "all_cards_ms")
	// A node event, once the page is drawn: a cordon through the API.
	perEvent := t.nodeEventCost(s, s.machineIDs()[0])
	b.ReportMetric(perEvent.records, "mutations/node_event")
	b.ReportMetric(perEvent.cardsPer, "cards_rebuilt/node_event")
	t.shot("fleet-large")
}
