package console

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// countFleetEvents wraps the page's fetch so that the events of the fleet
// stream (GET /v1/fleet/events, which the console reads with fetch, as
// EventSource cannot send a Bearer token) are counted by name in
// window.__sse, and a MutationObserver counts, in window.__mut, what
// changes under the fleet's pools: mutation records, nodes added, and
// machine cards added (a card rebuilt is one removed and one added).
const countFleetEvents = `
window.__sse = {};
window.__mut = {records: 0, added: 0, cards: 0};
const __fetch = window.fetch;
window.fetch = async function (input, init) {
  const res = await __fetch.apply(this, arguments);
  const url = typeof input === 'string' ? input : input.url;
  if (!url.includes('/v1/fleet/events') || !res.body) return res;
  const [mine, theirs] = res.body.tee();
  (async () => {
    const r = mine.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    for (;;) {
      const {value, done} = await r.read();
      if (done) return;
      buf += value;
      let i;
      while ((i = buf.indexOf('\n\n')) >= 0) {
        const m = /^event: ?([\w-]+)/m.exec(buf.slice(0, i));
        buf = buf.slice(i + 2);
        if (m) window.__sse[m[1]] = (window.__sse[m[1]] || 0) + 1;
      }
    }
  })().catch(() => {});
  return new Response(theirs, {status: res.status, statusText: res.statusText, headers: res.headers});
};
window.__observeFleet = () => {
  const root = document.querySelector('[data-testid=fleet-pools]');
  if (!root) return false;
  new MutationObserver(recs => {
    for (const r of recs) {
      window.__mut.records++;
      window.__mut.added += r.addedNodes.length;
      for (const n of r.addedNodes) if (n.matches && n.matches('article[data-testid^="node-"]')) window.__mut.cards++;
    }
  }).observe(root, {childList: true, subtree: true, attributes: true, characterData: true});
  return true;
};
`

// fleetCounts is what countFleetEvents counted.
type fleetCounts struct {
	SSE map[string]int `json:"sse"`
	Mut struct {
		Records int `json:"records"`
		Added   int `json:"added"`
		Cards   int `json:"cards"`
	} `json:"mut"`
}

func (b *tab) fleetCounts() fleetCounts {
	return eval[fleetCounts](b, "({sse: window.__sse, mut: window.__mut})")
}

// TestFleetRebuildsOnlyTheCardOfANodeEvent: with the fleet page open and
// its first snapshot drawn, node events (telemetry, and a cordon made
// through the API) rebuild at most the card of their machine, never the
// fleet; the cordoned machine's card shows the hold live, and the cards
// of the others are the same elements as before.
func TestFleetRebuildsOnlyTheCardOfANodeEvent(t *testing.T) {
	s := needStack(t)
	b := s.open(t, desktopWidth, 900)
	b.addScript(countFleetEvents)
	b.login(s.ep.AdminToken)
	b.navigate("/ui/fleet")
	b.until("the fleet's first snapshot", contains(s.machineIDs()...)+" && window.__sse.snapshot >= 1")
	c := b.nodeEventCost(s, "a100-02")
	if c.events < 1 {
		t.Fatalf("no node event counted on the fleet stream")
	}
	if c.rebuilt > c.events {
		t.Errorf("%d cards rebuilt for %d node events: an event rebuilt more than its machine's card", c.rebuilt, c.events)
	}
	if c.kept == 0 {
		t.Errorf("every card was rebuilt after %d node events", c.events)
	}
	b.shot("fleet-cordoned")
}

// eventCost is what node events cost the fleet page once drawn.
type eventCost struct {
	events, rebuilt, mutations, kept, cards int
	// records and cards per node event.
	records, cardsPer float64
}

// nodeEventCost observes the fleet page (loaded with countFleetEvents
// and drawn) while victim is cordoned through the API and a couple of
// seconds of telemetry pass, and checks the victim's card shows the hold
// as a new element. The cordon is lifted when the test ends.
func (b *tab) nodeEventCost(s *stack, victim string) eventCost {
	b.t.Helper()
	if !eval[bool](b, "window.__observeFleet()") {
		b.fail("no [data-testid=fleet-pools] to observe")
	}
	// Each card carries a mark; a card rebuilt is a new element without it.
	cards := eval[int](b, `(() => { const cs = document.querySelectorAll('article[data-testid^="node-"]');
		cs.forEach(c => c.__mark = true); return cs.length; })()`)
	before := b.fleetCounts()
	ctx := b.t.Context()
	if _, err := s.admin.HoldNode(ctx, victim, gpuplane.Cordon, "console test: one node event"); err != nil {
		b.t.Fatal(err)
	}
	b.t.Cleanup(func() { _, _ = s.admin.HoldNode(context.Background(), victim, gpuplane.Uncordon, "") })
	card := fmt.Sprintf(`document.querySelector('article[data-testid="node-%s"]')`, safeID(victim))
	// textContent: on a large fleet a card off the screen is not rendered
	// (content-visibility), and innerText leaves its text out.
	b.until("the cordon on "+victim+"'s card", card+` && `+card+`.textContent.includes('cordoned')`)
	if eval[bool](b, card+".__mark === true") {
		b.t.Errorf("%s's card shows the cordon but is the element from before it", victim)
	}
	// Let a few telemetry events come too, then count.
	time.Sleep(2 * time.Second)
	after := b.fleetCounts()
	c := eventCost{events: after.SSE["node"] - before.SSE["node"], rebuilt: after.Mut.Cards - before.Mut.Cards,
		mutations: after.Mut.Records - before.Mut.Records, cards: cards,
		kept: eval[int](b, `[...document.querySelectorAll('article[data-testid^="node-"]')].filter(c => c.__mark).length`)}
	c.records = float64(c.mutations) / float64(max(c.events, 1))
	c.cardsPer = float64(c.rebuilt) / float64(max(c.events, 1))
	b.t.Logf("fleet page, %d machine cards: %d node events, %d cards rebuilt (%.2f per event), %d mutation records (%.1f per event), %d cards untouched",
		cards, c.events, c.rebuilt, c.cardsPer, c.mutations, c.records, c.kept)
	return c
}

// TestFaultTurnsTheGPUUnhealthyAndTheJobMigrates: a checkpointable job
// runs on an A100; an XID error injected into its GPU through the API
// turns that GPU unhealthy on the fleet page, live, and the job's page
// shows it migrate and succeed on another GPU, without a reload.
func TestFaultTurnsTheGPUUnhealthyAndTheJobMigrates(t *testing.T) {
	s := needStack(t)
	ctx := t.Context()
	id := "console-migrate"
	if _, err := s.admin.Submit(ctx, tenant, contracts.JobRequest{ID: id, Name: "moves when its GPU fails",
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "A100-80GB"}},
		Run:       contracts.RunSpec{Duration: contracts.Duration(12 * time.Second), Checkpoint: true}}); err != nil {
		t.Fatal(err)
	}
	var job contracts.JobStatus
	eventually(t, id+" running", func() (bool, string) {
		var err error
		job, err = s.admin.Job(ctx, tenant, id)
		return err == nil && job.State == contracts.StateRunning && job.Placement != nil, fmt.Sprint(job.State, err)
	})
	node, gpu := job.Placement.NodeID, job.Placement.Devices[0].UUID

	fleetTab := s.open(t, desktopWidth, 900)
	fleetTab.login(s.ep.AdminToken)
	fleetTab.navigate("/ui/fleet?q=" + node)
	cell := fmt.Sprintf(`document.querySelector('li.gpu[data-testid="gpu-%s"]')`, safeID(gpu))
	fleetTab.until("the job's GPU busy with it", cell+` && (`+cell+`.dataset.owner || '').includes(`+jsString(tenant+"/"+id)+`)`)
	jobTab := s.open(t, desktopWidth, 900)
	jobTab.login(s.ep.AdminToken)
	jobTab.navigate("/ui/jobs/" + tenant + "/" + id)
	jobTab.until("the job page", contains(id, "running"))
	for _, b := range []*tab{fleetTab, jobTab} {
		_ = eval[bool](b, "window.__sameDocument = true")
	}

	if _, err := s.admin.InjectFault(ctx, node, contracts.FaultRequest{Kind: contracts.FaultXID, GPU: gpu, Code: contracts.DefaultFaultXID}); err != nil {
		t.Fatal(err)
	}
	fleetTab.until("the GPU unhealthy on the fleet page", cell+` && `+cell+`.dataset.state === 'unhealthy'`)
	fleetTab.shot("fleet-unhealthy")
	timeline := `[...document.querySelectorAll('[data-testid=timeline-event]')].map(e => e.dataset.type)`
	jobTab.until("the migration on the job's timeline", timeline+`.includes('migrating') && `+timeline+`.includes('migrated')`)
	jobTab.untilWithin(2*waitFor, "the job succeeded on its page", `document.querySelector('[data-testid=job-state]').dataset.state === 'succeeded'`)
	jobTab.shot("job-migrated")
	for _, b := range []*tab{fleetTab, jobTab} {
		if !eval[bool](b, "window.__sameDocument === true") {
			t.Errorf("the page reloaded to show the change")
		}
	}
}

// safeID is the console's safeId: what a data-testid makes of an ID.
func safeID(s string) string {
	out := []rune(s)
	for i, r := range out {
		if !(r == '_' || r == '.' || r == '-' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			out[i] = '_'
		}
	}
	return string(out)
}
