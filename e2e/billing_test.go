package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/e2e/oracle"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/gateway"
)

// dayFleet is the fleet of TestBillingOverASimulatedDay: one pool per
// price class.
const dayFleet = `machineTypes:
  hgx-h100-8:
    gpuModel: H100-80GB
    gpuCount: 8
    nvlink: true
  hgx-a100-8:
    gpuModel: A100-80GB
    gpuCount: 8
    nvlink: true
  pcie-l4-4:
    gpuModel: L4
    gpuCount: 4
    nvlink: false
pools:
  - name: h100
    machineType: hgx-h100-8
    count: 2
    priceClass: on-demand
  - name: a100
    machineType: hgx-a100-8
    count: 1
    priceClass: reserved
  - name: l4
    machineType: pcie-l4-4
    count: 2
    priceClass: spot
`

// dayPools is what the test knows of dayFleet: each pool's GPU model and
// price class.
var dayPools = map[string]struct {
	model string
	class contracts.PriceClass
}{
	"h100": {"H100-80GB", contracts.PriceOnDemand},
	"a100": {"A100-80GB", contracts.PriceReserved},
	"l4":   {"L4", contracts.PriceSpot},
}

// TestBillingOverASimulatedDay runs a day of mixed work, compressed (runs
// of seconds stand for hours), on a fleet of on-demand, reserved and spot
// machines, with the scheduler, the resource manager, billing, the gateway
// and the fleet as separate processes on a real NATS server (and billing's
// totals in a real Redis when redis-server is installed). Runs succeed,
// fail, are cancelled mid-run, and die with their machine (released as
// node_lost, requeued, run again elsewhere: a migration, for billing). The
// price book changes in the middle of runs. Billing is SIGKILLed and
// restarted several times. At the end:
//   - the oracle finds every run billed exactly once, to the second of its
//     run facts (or of its release, for a lost machine), in contiguous
//     segments split at the price change;
//   - the cost of every tenant, computed here independently from the run
//     facts and the price book, equals the sum of the usage records to the
//     micro-unit and the gateway's invoice to the cent;
//   - the budgets' policies hold: reject, spot-only and notify, with one
//     alert per threshold;
//   - Redis's totals equal the records', and again after Redis is flushed
//     and billing rebuilds them from USAGE.
func TestBillingOverASimulatedDay(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the services as processes")
	}
	sd := seed(t)
	rng := rand.New(rand.NewPCG(sd, 5))
	bin := t.TempDir()
	buildServicesAnd(t, bin, "./services/gateway/cmd/gateway")
	begin := time.Now()

	ns := natstest.Start(t)
	tmp := t.TempDir()
	fleetPath := filepath.Join(tmp, "fleet.yaml")
	if err := os.WriteFile(fleetPath, []byte(dayFleet), 0o644); err != nil {
		t.Fatal(err)
	}
	s := connectClient(t, ns.URL(), natstest.Operator(t, ns), "e2e-billing-client")
	nc, js := s.nc, s.js
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// The price book as it stood before this day (the gateway refuses
	// versions in the past, so the history is written straight into KV).
	var bookKV jetstream.KeyValue
	var err error
	for _, cfg := range contracts.KeyValues(contracts.StreamOptions{}) {
		if cfg.Bucket == contracts.BucketPriceBook {
			if bookKV, err = js.CreateOrUpdateKeyValue(ctx, cfg); err != nil {
				t.Fatal(err)
			}
		}
	}
	v1 := contracts.PriceVersion{ID: "v1", EffectiveFrom: time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC), Currency: "USD",
		GPU: map[string]contracts.GPUPrices{
			"H100-80GB": {OnDemand: 36_000_000, Spot: 14_400_000, Reserved: 25_200_000},
			"A100-80GB": {OnDemand: 21_600_000, Reserved: 14_040_000},
			"L4":        {OnDemand: 3_600_000, Spot: 1_260_000},
		}}
	book := contracts.PriceBook{SchemaVersion: 1, Versions: []contracts.PriceVersion{v1}}
	data, _ := json.Marshal(book)
	if _, err := bookKV.Put(ctx, contracts.KeyPriceBook, data); err != nil {
		t.Fatal(err)
	}

	redis := startRedisForE2E(t)
	gwAddr := freeAddr(t)
	billingArgs := []string{"-budget-interval", "200ms", "-store-retry", "300ms"}
	if redis != nil {
		billingArgs = append(billingArgs, "-redis", redis.addr)
	}
	order := []string{"fleet-sim", "resource-manager", "scheduler", "billing", "gateway"}
	children := startChildren(t, bin, tmp, ns, order, map[string][]string{
		"fleet-sim": {"-fleet", fleetPath, "-log-dir", t.TempDir()},
		"billing":   billingArgs,
		"gateway":   {"-addr", gwAddr},
	})
	gw := &gatewayClient{t: t, base: "http://" + gwAddr}
	// The gateway process reads its tokens from KV: an admin's for this test.
	adminToken, err := gateway.IssueTokenJS(ctx, js, gateway.Grant{ID: "e2e-admin", Name: "e2e admin",
		Bindings: []contracts.Binding{{Role: contracts.RolePlatformAdmin}}})
	if err != nil {
		t.Fatal(err)
	}
	authorize(gw.base, adminToken)
	waitFor(t, time.Minute, "the gateway", func() (bool, string) {
		status, body := gw.do(http.MethodGet, "/healthz", nil, nil)
		return status == http.StatusOK, string(body)
	})
	w := s.watchJobs(t)

	// Budgets of three tenants, one per policy: 0.05 USD a month.
	capped := map[string]contracts.BudgetPolicy{"cap-reject": contracts.PolicyReject, "cap-spot": contracts.PolicySpotOnly,
		"cap-notify": contracts.PolicyNotify}
	for tenant, policy := range capped {
		body := fmt.Sprintf(`{"period":"monthly","limit":"0.05","policy":%q}`, policy)
		if status, b := gw.do(http.MethodPut, "/v1/tenants/"+tenant+"/budget", []byte(body), nil); status != http.StatusOK {
			t.Fatalf("budget of %s: %d %s", tenant, status, b)
		}
	}

	// The day's work. Durations are seconds standing for hours.
	var jobs []submitted
	add := func(tenant, id string, gpu contracts.GPURequest, pool string, d time.Duration, exit int, prio contracts.Priority) {
		req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: gpu}, Pool: pool, Priority: prio,
			Run: contracts.RunSpec{Duration: contracts.Duration(d), ExitCode: exit}}
		jobs = append(jobs, submitted{tenant: tenant, id: id, req: req})
	}
	shapes := []struct {
		gpu  contracts.GPURequest
		pool string
	}{
		{contracts.GPURequest{Count: 1, Model: contracts.GPUModelAny}, ""},
		{contracts.GPURequest{Count: 2, Model: "H100-80GB"}, ""},
		{contracts.GPURequest{Count: 4, Model: "H100-80GB"}, "h100"},
		{contracts.GPURequest{Count: 1, Model: "L4"}, "l4"},
		{contracts.GPURequest{Count: 4, Model: "L4"}, ""},
		{contracts.GPURequest{Count: 2, Model: "A100-80GB"}, "a100"},
		{contracts.GPURequest{Count: 8, Model: "A100-80GB"}, ""},
	}
	for i := range 36 {
		sh := shapes[rng.IntN(len(shapes))]
		exit := 0
		if rng.IntN(8) == 0 {
			exit = 3 // a failure
		}
		prio := contracts.PriorityNormal
		if rng.IntN(4) == 0 {
			prio = contracts.PriorityBestEffort
		}
		add([]string{"acme", "globex"}[rng.IntN(2)], fmt.Sprintf("day-%02d", i), sh.gpu, sh.pool,
			time.Duration(1000+rng.IntN(3500))*time.Millisecond, exit, prio)
	}
	for tenant := range capped {
		for k := range 2 {
			add(tenant, fmt.Sprintf("spend-%d", k), contracts.GPURequest{Count: 2, Model: "H100-80GB"}, "h100",
				2500*time.Millisecond, 0, contracts.PriorityHigh)
		}
	}
	for k := range 3 {
		add("acme", fmt.Sprintf("cancel-%d", k), contracts.GPURequest{Count: 1, Model: "L4"}, "l4", 8*time.Second, 0, contracts.PriorityHigh)
	}
	// A whole H100 machine for 8 s: its machine dies under it.
	add("globex", "doomed", contracts.GPURequest{Count: 8, Model: "H100-80GB"}, "h100", 8*time.Second, 0, contracts.PriorityCritical)
	slices.SortFunc(jobs, func(a, b submitted) int { return int(a.req.Priority.Rank()-b.req.Priority.Rank()) * -1 })

	submitStart := time.Now()
	for _, j := range jobs {
		body, _ := json.Marshal(j.req)
		if _, err := s.submitBus(ctx, j.tenant, contracts.SubmitMsgID(j.tenant, j.id), body); err != nil {
			t.Fatal(err)
		}
	}

	var wg sync.WaitGroup
	errs := make(chan error, 20)
	// Billing dies four times while the day goes on.
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(sd, 6)) // each goroutine its own: rand.Rand is not safe to share
		for k := range 4 {
			time.Sleep(time.Duration(700+rng.IntN(2500)) * time.Millisecond) // the moment of the kill
			if err := children["billing"].kill(); err != nil {
				errs <- err
				return
			}
			down := time.Duration(100+rng.IntN(1200)) * time.Millisecond
			time.Sleep(down)
			if err := children["billing"].start(); err != nil {
				errs <- err
				return
			}
			t.Logf("billing SIGKILLed #%d at +%s, down %s", k+1, time.Since(submitStart).Round(time.Millisecond), down)
		}
	})
	// Three runs are cancelled while they run.
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(sd, 7))
		for k := range 3 {
			id := fmt.Sprintf("cancel-%d", k)
			if !poll(ctx, func() bool { ev, _ := w.get("acme/" + id); return ev.Type == contracts.EventRunning }) {
				errs <- fmt.Errorf("%s never ran", id)
				return
			}
			time.Sleep(time.Duration(300+rng.IntN(1500)) * time.Millisecond) // how long it runs before the cancel
			cr, _ := json.Marshal(contracts.CancelRequest{JobID: id, Reason: "e2e: cancelled mid-run"})
			msg := nats.NewMsg(contracts.SubjectCancel("acme"))
			msg.Data = cr
			msg.Header.Set(contracts.HeaderMsgID, contracts.CancelMsgID("acme", id))
			if _, err := js.PublishMsg(ctx, msg); err != nil {
				errs <- err
			}
		}
	})
	// The machine of "doomed" dies 1.5 s into its run.
	var lostNode string
	wg.Go(func() {
		var ev contracts.JobEvent
		if !poll(ctx, func() bool {
			ev, _ = w.get("globex/doomed")
			return ev.Type == contracts.EventRunning && ev.Placement != nil
		}) {
			errs <- fmt.Errorf("globex/doomed never ran")
			return
		}
		lostNode = ev.Placement.NodeID
		time.Sleep(1500 * time.Millisecond)
		f := contracts.Fault{ID: "e2e-death", Kind: contracts.FaultMachineDeath}
		cmd := contracts.NodeCommand{SchemaVersion: 1, Kind: contracts.CommandInjectFault, Fault: &f, Time: time.Now().UTC()}
		b, _ := json.Marshal(cmd)
		msg := nats.NewMsg(contracts.SubjectNodeCommands(lostNode))
		msg.Data = b
		msg.Header.Set(contracts.HeaderMsgID, contracts.FaultCommandID(lostNode, f.ID))
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			errs <- err
		}
		t.Logf("machine %s killed at +%s under globex/doomed", lostNode, time.Since(submitStart).Round(time.Millisecond))
	})
	// The price book changes, taking effect during many runs.
	var change time.Time
	wg.Go(func() {
		time.Sleep(1200 * time.Millisecond)
		change = time.Now().Add(1500 * time.Millisecond).Truncate(time.Second).UTC()
		v2 := v1
		v2.ID, v2.EffectiveFrom = "v2", change
		v2.GPU = map[string]contracts.GPUPrices{
			"H100-80GB": {OnDemand: 32_400_000, Spot: 12_960_000, Reserved: 22_680_000},
			"A100-80GB": {OnDemand: 19_440_000, Reserved: 12_636_000},
			"L4":        {OnDemand: 3_240_000, Spot: 1_134_000},
		}
		book.Versions = append(book.Versions, v2)
		body, _ := json.Marshal(book)
		if status, b := gw.do(http.MethodPut, "/v1/pricebook", body, nil); status != http.StatusOK {
			errs <- fmt.Errorf("price change: %d %s", status, b)
		}
		t.Logf("price v2 takes effect at +%s", change.Sub(submitStart).Round(time.Millisecond))
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		t.FailNow()
	}

	// Every job ends: succeeded, failed (exit 3) or cancelled.
	waitFor(t, 3*time.Minute, "every job to end", func() (bool, string) {
		done, states := 0, map[contracts.JobState]int{}
		for _, j := range jobs {
			ev, _ := w.get(j.tenant + "/" + j.id)
			states[ev.State]++
			if ev.State.Terminal() {
				done++
			}
		}
		return done == len(jobs), fmt.Sprintf("%v", states)
	})
	for _, j := range jobs {
		ev, _ := w.get(j.tenant + "/" + j.id)
		want := contracts.StateSucceeded
		switch {
		case strings.HasPrefix(j.id, "cancel-"):
			want = contracts.StateCancelled
		case j.req.Run.ExitCode != 0:
			want = contracts.StateFailed
		}
		if ev.State != want {
			t.Errorf("%s/%s: %s (%s %s), want %s", j.tenant, j.id, ev.State, ev.Reason, ev.Message, want)
		}
	}
	if ev, _ := w.get("globex/doomed"); ev.Attempt < 2 {
		t.Errorf("globex/doomed ended at attempt %d: its machine died, it should have run again", ev.Attempt)
	}

	// The budgets: every capped tenant is over its 0.05 USD.
	for tenant, policy := range capped {
		var doc contracts.BudgetDoc
		waitFor(t, time.Minute, tenant+"'s budget status", func() (bool, string) {
			gw.do(http.MethodGet, "/v1/tenants/"+tenant+"/budget", nil, &doc)
			return doc.Status != nil && doc.Status.Exceeded, fmt.Sprintf("%+v", doc.Status)
		})
		if !slices.Equal(doc.Status.Alerted, []int{50, 80, 100}) || doc.Status.Policy != policy {
			t.Errorf("%s: status %+v", tenant, doc.Status)
		}
	}
	probe := func(tenant, id string, req contracts.JobRequest) contracts.JobEvent {
		t.Helper()
		req.ID = id
		body, _ := json.Marshal(req)
		if _, err := s.submitBus(ctx, tenant, contracts.SubmitMsgID(tenant, id), body); err != nil {
			t.Fatal(err)
		}
		var ev contracts.JobEvent
		waitFor(t, 30*time.Second, tenant+"/"+id+" to be answered", func() (bool, string) {
			var ok bool
			ev, ok = w.get(tenant + "/" + id)
			return ok && ev.Type != "", "no event"
		})
		return ev
	}
	small := contracts.JobRequest{Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "L4"}},
		Run: contracts.RunSpec{Duration: contracts.Duration(1500 * time.Millisecond)}}
	spotPool, bestEffort := small, small
	spotPool.Pool = "l4"
	bestEffort.Priority = contracts.PriorityBestEffort
	var probed []string // tenant/job of every probe admitted: they must end before the checks
	for _, c := range []struct {
		tenant, id string
		req        contracts.JobRequest
		admitted   bool
	}{
		{"cap-reject", "after-1", small, false},
		{"cap-reject", "after-2", bestEffort, false},
		{"cap-spot", "after-1", small, false},
		{"cap-spot", "after-2", spotPool, true},
		{"cap-spot", "after-3", bestEffort, true},
		{"cap-notify", "after-1", small, true},
	} {
		// The status reaches the scheduler through the bus a moment after
		// the gateway shows it: a refusal may take a few tries, each
		// under a new ID (a rejected ID stays rejected).
		var ev contracts.JobEvent
		for try := 0; ; try++ {
			id := fmt.Sprintf("%s-%d", c.id, try)
			ev = probe(c.tenant, id, c.req)
			if ev.Type != contracts.EventRejected {
				probed = append(probed, c.tenant+"/"+id)
			}
			if c.admitted || ev.Type == contracts.EventRejected || try == 20 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if got := ev.Type != contracts.EventRejected; got != c.admitted {
			t.Errorf("%s/%s: %s %s %s; want admitted=%v", c.tenant, c.id, ev.Type, ev.Reason, ev.Message, c.admitted)
		} else if !c.admitted && ev.Reason != contracts.ReasonBudgetExceeded {
			t.Errorf("%s/%s rejected with %s, want budget_exceeded", c.tenant, c.id, ev.Reason)
		}
	}
	for _, key := range probed {
		waitFor(t, time.Minute, key+" to end", func() (bool, string) {
			ev, _ := w.get(key)
			return ev.State.Terminal(), string(ev.State)
		})
	}
	alerts := budgetAlerts(t, ctx, js)
	for tenant := range capped {
		if got := alerts[tenant]; !slices.Equal(got, []string{"50", "80", "100"}) {
			t.Errorf("%s: budget alerts %v, want one each at 50, 80 and 100%%", tenant, got)
		}
	}

	// Billing catches up; the oracle checks the whole history.
	var rep *oracle.Report
	waitFor(t, 2*time.Minute, "usage records for every run", func() (bool, string) {
		if rep, err = oracle.Check(ctx, nc); err != nil {
			return false, err.Error()
		}
		ran, billed := 0, 0
		for id := range rep.Runs {
			if _, _, ok := rep.RunSpan(id); !ok {
				continue
			}
			ran++
			if recs := rep.Usage[id]; len(recs) > 0 && slices.ContainsFunc(recs, func(u contracts.UsageRecord) bool { return u.Final }) {
				billed++
			}
		}
		return ran > 0 && billed == ran, fmt.Sprintf("%d runs over, %d billed to the end", ran, billed)
	})
	billedMs, expectedMs := rep.CheckMetering()
	rep.CheckBillingMatchesRuns()
	if err := rep.Err(); err != nil {
		t.Fatal(err)
	}
	if billedMs != expectedMs || billedMs == 0 {
		t.Fatalf("billed %d GPU-ms, runs held %d GPU-ms", billedMs, expectedMs)
	}

	// The lost machine's run billed up to its release, and its next
	// attempt elsewhere.
	var lostBilled bool
	for id, rel := range rep.Released {
		if rel.Reason != contracts.ReasonNodeLost || rel.Allocation.NodeID != lostNode {
			continue
		}
		if rep.Runs[id] == nil || rep.Runs[id].Ended != 0 {
			t.Errorf("%s was released as node_lost but has an ended fact", id)
		}
		if recs := rep.Usage[id]; len(recs) > 0 && recs[len(recs)-1].Reason == contracts.ReasonNodeLost {
			lostBilled = true
		}
	}
	if !lostBilled {
		t.Errorf("no run of the lost machine %s was billed as node_lost", lostNode)
	}
	if recs := rep.Usage[contracts.AllocationID("globex", "doomed", 2)]; len(recs) == 0 || recs[0].NodeID == lostNode {
		t.Errorf("globex/doomed attempt 2: %+v, want it billed on another machine", recs)
	}

	// Costs, computed here from the run facts and the price book alone.
	want := map[string]int64{}
	split := 0
	for id, run := range rep.Runs {
		start, end, ok := rep.RunSpan(id)
		if !ok {
			continue
		}
		from, to := oracle.BilledSpan(start, end)
		pool := rep.Usage[id][0].Pool
		p, known := dayPools[pool]
		if !known {
			t.Fatalf("%s ran on pool %q", id, pool)
		}
		want[rep.Usage[id][0].Tenant] += independentCost(book, p.model, p.class, run.GPUs, from, to)
		if from.Before(change) && to.After(change) {
			split++
			recs := rep.Usage[id]
			cut := slices.IndexFunc(recs, func(u contracts.UsageRecord) bool { return u.Start.Equal(change) })
			if cut < 1 || recs[cut-1].PriceVersion != "v1" || recs[cut].PriceVersion != "v2" {
				t.Errorf("%s ran across the price change at %s but was not split there: %+v", id, change, recs)
			}
		}
	}
	if split == 0 {
		t.Errorf("no run spanned the price change at %s", change)
	}
	got := map[string]int64{}
	for _, recs := range rep.Usage {
		for _, u := range recs {
			got[u.Tenant] += u.CostMicros
		}
	}
	for tenant, micros := range want {
		if got[tenant] != micros {
			t.Errorf("%s: records cost %d micro-USD, the run facts and the price book say %d", tenant, got[tenant], micros)
		}
		var inv contracts.Invoice
		month := time.Now().UTC().Format("2006-01")
		waitFor(t, 30*time.Second, tenant+"'s invoice", func() (bool, string) {
			gw.do(http.MethodGet, "/v1/tenants/"+tenant+"/invoice?period="+month, nil, &inv)
			return inv.TotalMicros == micros, fmt.Sprintf("invoice %d micro-USD (%s), want %d", inv.TotalMicros, inv.Total, micros)
		})
		if inv.Total != contracts.Money(micros).CentString() {
			t.Errorf("%s: invoice total %s, want %s", tenant, inv.Total, contracts.Money(micros).CentString())
		}
		t.Logf("%s", inv)
	}

	// Redis holds the same totals; flushed, it is rebuilt from USAGE.
	if redis == nil && os.Getenv("GPUPLANE_REQUIRE_REDIS") != "" {
		t.Error("redis-server is not on PATH and GPUPLANE_REQUIRE_REDIS is set (CI): the Redis checks must run")
	} else if redis == nil {
		t.Log("redis-server is not on PATH: billing kept its totals in memory; the Redis checks did not run")
	} else {
		checkRedis := func(when string) {
			waitFor(t, time.Minute, "Redis totals "+when, func() (bool, string) {
				rep, err := oracle.Check(ctx, nc)
				if err != nil {
					return false, err.Error()
				}
				sums := map[string][4]int64{}
				for _, recs := range rep.Usage {
					for _, u := range recs {
						s := sums[u.Tenant]
						s[0]++
						s[1] += u.GPUMillis
						s[2] += u.CostMicros
						s[3] += u.OnDemandCostMicros
						sums[u.Tenant] = s
					}
				}
				for tenant, s := range sums {
					if r := redis.totals(t, tenant); r != s {
						return false, fmt.Sprintf("%s: Redis %v, records %v", tenant, r, s)
					}
				}
				return true, ""
			})
		}
		checkRedis("after the day")
		redis.flush(t)
		// The next record tells billing its store was emptied.
		probe("acme", "after-flush", spotPool)
		waitFor(t, time.Minute, "acme/after-flush to end", func() (bool, string) {
			ev, _ := w.get("acme/after-flush")
			return ev.State.Terminal(), string(ev.State)
		})
		checkRedis("rebuilt after FLUSHALL")
	}

	for _, name := range order {
		for _, e := range children[name].unexpectedExits() {
			t.Error(e)
		}
	}
	t.Logf("oracle: %s; %d runs, %d split at the price change; billed %.0f GPU-s; whole test %.1fs (without the build)",
		rep.Summary(), len(rep.Runs), split, float64(billedMs)/1000, time.Since(begin).Seconds())
}

// poll checks cond every 20 ms until it holds (true) or ctx ends (false):
// waitFor for goroutines other than the test's.
func poll(ctx context.Context, cond func() bool) bool {
	for !cond() {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
	return true
}

// independentCost prices gpus GPUs of model in class over the whole
// seconds [from, to): cut at every price version and UTC midnight, each
// piece rounded half to even to the micro-unit. It shares no code with
// billing.
func independentCost(book contracts.PriceBook, model string, class contracts.PriceClass, gpus int, from, to time.Time) int64 {
	cuts := []time.Time{from, to}
	for _, v := range book.Versions {
		if v.EffectiveFrom.After(from) && v.EffectiveFrom.Before(to) {
			cuts = append(cuts, v.EffectiveFrom)
		}
	}
	for d := time.Date(from.Year(), from.Month(), from.Day()+1, 0, 0, 0, 0, time.UTC); d.Before(to); d = d.AddDate(0, 0, 1) {
		cuts = append(cuts, d)
	}
	sort.Slice(cuts, func(i, j int) bool { return cuts[i].Before(cuts[j]) })
	var total int64
	for i := 0; i+1 < len(cuts); i++ {
		a, b := cuts[i], cuts[i+1]
		if !a.Before(b) {
			continue
		}
		var rate int64
		for _, v := range book.Versions { // the last version in effect at a
			if !v.EffectiveFrom.After(a) {
				p := v.GPU[model]
				rate = int64(p.OnDemand)
				if class == contracts.PriceSpot && p.Spot > 0 {
					rate = int64(p.Spot)
				}
				if class == contracts.PriceReserved && p.Reserved > 0 {
					rate = int64(p.Reserved)
				}
			}
		}
		n := rate * int64(gpus) * int64(b.Sub(a)/time.Second) // micro-USD × GPU-seconds per hour
		q, r := n/3600, n%3600
		if 2*r > 3600 || 2*r == 3600 && q%2 == 1 {
			q++
		}
		total += q
	}
	return total
}

// budgetAlerts reads the budget alerts in OPS: tenant → thresholds.
func budgetAlerts(t *testing.T, ctx context.Context, js jetstream.JetStream) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	s, err := js.Stream(ctx, contracts.StreamOps)
	if err != nil {
		t.Fatal(err)
	}
	last, err := s.GetLastMsgForSubject(ctx, contracts.SubjectAlert(contracts.AlertKindBudget))
	if err != nil {
		t.Fatalf("no budget alert: %v", err)
	}
	cons, err := js.OrderedConsumer(ctx, contracts.StreamOps, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{contracts.SubjectAlert(contracts.AlertKindBudget)}})
	if err != nil {
		t.Fatal(err)
	}
	it, err := cons.Messages()
	if err != nil {
		t.Fatal(err)
	}
	defer it.Stop()
	for {
		m, err := it.Next(jetstream.NextContext(ctx))
		if err != nil {
			t.Fatal(err)
		}
		var a contracts.Alert
		if err := json.Unmarshal(m.Data(), &a); err == nil {
			out[a.Labels["tenant"]] = append(out[a.Labels["tenant"]], a.Labels["threshold"])
		}
		if md, _ := m.Metadata(); md != nil && md.Sequence.Stream >= last.Sequence {
			return out
		}
	}
}

// buildServicesAnd builds buildServices' binaries and the extra packages.
func buildServicesAnd(t *testing.T, dir string, extra ...string) {
	t.Helper()
	buildServices(t, dir)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", append([]string{"build", "-o", dir}, extra...)...)
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %v: %v\n%s", extra, err, out)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// gatewayClient calls a gateway process.
type gatewayClient struct {
	t    *testing.T
	base string
}

func (g *gatewayClient) do(method, path string, body []byte, out any) (int, []byte) {
	g.t.Helper()
	req, err := http.NewRequest(method, g.base+path, bytes.NewReader(body))
	if err != nil {
		g.t.Fatal(err)
	}
	res, err := authClient.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if out != nil && res.StatusCode/100 == 2 {
		_ = json.Unmarshal(b, out)
	}
	return res.StatusCode, b
}

// redisServer is a redis-server for one test, driven with redis-cli.
type redisServer struct {
	addr, port, cli string
}

// startRedisForE2E starts redis-server on a free port when it is on PATH;
// nil otherwise (billing then keeps its totals in memory).
func startRedisForE2E(t *testing.T) *redisServer {
	t.Helper()
	srv, err1 := exec.LookPath("redis-server")
	cli, err2 := exec.LookPath("redis-cli")
	if err1 != nil || err2 != nil {
		return nil
	}
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	dir := t.TempDir()
	cmd := exec.Command(srv, "--port", port, "--bind", "127.0.0.1", "--dir", dir, "--save", "", "--appendonly", "no",
		"--daemonize", "no", "--logfile", filepath.Join(dir, "redis.log"))
	if err := cmd.Start(); err != nil {
		t.Fatalf("redis-server: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	r := &redisServer{addr: addr, port: port, cli: cli}
	waitFor(t, 10*time.Second, "redis-server", func() (bool, string) {
		out, err := exec.Command(cli, "-p", port, "PING").CombinedOutput()
		return err == nil && strings.TrimSpace(string(out)) == "PONG", string(out)
	})
	return r
}

// totals reads billing's totals of tenant: records, GPU-ms, cost and
// on-demand cost (the layout of services/billing's RedisStore).
func (r *redisServer) totals(t *testing.T, tenant string) [4]int64 {
	t.Helper()
	out, err := exec.Command(r.cli, "-p", r.port, "HMGET", "{gp-billing}:tenant:"+tenant, "n", "gms", "cost", "od").Output()
	if err != nil {
		t.Fatalf("redis-cli: %v", err)
	}
	var v [4]int64
	for i, f := range strings.Fields(string(out)) {
		if i < 4 {
			v[i], _ = strconv.ParseInt(f, 10, 64)
		}
	}
	return v
}

func (r *redisServer) flush(t *testing.T) {
	t.Helper()
	if out, err := exec.Command(r.cli, "-p", r.port, "FLUSHALL").CombinedOutput(); err != nil {
		t.Fatalf("FLUSHALL: %v %s", err, out)
	}
}
