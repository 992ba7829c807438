package nodeagent_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/runner"
)

// gatedRegistry serves one image whose layer is held back until the test
// opens the gate: a pull as slow as the test wants, with no timing in it.
// It counts the layer's requests and sees each one its client gave up.
type gatedRegistry struct {
	ref   string // the image, tag form
	gate  chan struct{}
	open  sync.Once
	asked chan struct{} // one value per request of the layer
	gone  chan struct{} // one value per request of the layer its client gave up
	mu    sync.Mutex
	n     int
}

func newGatedRegistry(t *testing.T) *gatedRegistry {
	t.Helper()
	img, err := random.Image(64<<10, 1)
	if err != nil {
		t.Fatal(err)
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	layer, err := layers[0].Digest()
	if err != nil {
		t.Fatal(err)
	}
	g := &gatedRegistry{gate: make(chan struct{}), asked: make(chan struct{}, 16), gone: make(chan struct{}, 16)}
	inner := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	rs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/blobs/"+layer.String()) {
			g.mu.Lock()
			g.n++
			g.mu.Unlock()
			g.asked <- struct{}{}
			select {
			case <-g.gate:
			case <-r.Context().Done():
				g.gone <- struct{}{}
				return
			}
		}
		inner.ServeHTTP(w, r)
	}))
	// Opened before the server closes, so no handler waits for a client
	// that never gives up.
	t.Cleanup(rs.Close)
	t.Cleanup(g.release)
	g.ref = strings.TrimPrefix(rs.URL, "http://") + "/acme/slow:1"
	r, err := name.ParseReference(g.ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
	return g
}

// release opens the gate: the layer is served.
func (g *gatedRegistry) release() { g.open.Do(func() { close(g.gate) }) }

// layerRequests is how many times the layer was asked for.
func (g *gatedRegistry) layerRequests() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

// await waits for a value of c (a request of the layer, or one given up).
func await(t *testing.T, what string, c <-chan struct{}) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(limit):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// simContainers counts launches like countingRunner and runs a
// container as a simulated run of its image, so that the agent's handling
// of pulls is tested without runc (the container path itself is tested
// with it in containers_test.go). It checks that every container it is
// given has its image unpacked.
type simContainers struct {
	*countingRunner
	t *testing.T
}

func newSimContainers(t *testing.T) *simContainers {
	return &simContainers{countingRunner: newCountingRunner(t), t: t}
}

func (r *simContainers) Launch(ctx context.Context, l runner.Launch) (runner.Process, error) {
	if c := l.Container; c != nil {
		if _, err := os.Stat(c.Image.RootFS); err != nil {
			r.t.Errorf("container of %s launched without its image: %v", l.AllocationID, err)
		}
		l.Container, l.Spec = nil, contracts.RunSpec{Duration: contracts.Duration(100 * time.Millisecond)}
	}
	return r.countingRunner.Launch(ctx, l)
}

// kinds is the kinds of allocID's run facts, in stream order.
func kinds(r *recorder[contracts.RunEvent], allocID string) []contracts.RunKind {
	var out []contracts.RunKind
	for _, ev := range r.all() {
		if ev.AllocationID == allocID {
			out = append(out, ev.Kind)
		}
	}
	return out
}

// TestASlowPullHoldsUpNoOtherRun: a container whose image takes long to
// pull is pulled on its own; its commit is acked while it pulls, and a
// run committed after it on another GPU starts before the pull ends
// (the layer is held until that run's started fact is seen). The
// container then starts once, after its pulling facts.
func TestASlowPullHoldsUpNoOtherRun(t *testing.T) {
	reg := newGatedRegistry(t)
	b := connect(t)
	const node = "pull-slow"
	cfg := testConfig(t, node)
	sim := newSimContainers(t)
	cfg.Runner, cfg.ImageDir = sim, t.TempDir()
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	slow := allocation(node, "slow", contracts.RunSpec{Image: reg.ref, Command: []string{"/bin/true"}}, 0)
	seq := ledger(t, b, contracts.LedgerCommitted, slow, "")
	await(t, "the slow layer asked for", reg.asked)

	other := allocation(node, "other", contracts.RunSpec{Duration: contracts.Duration(100 * time.Millisecond)}, 1)
	ledger(t, b, contracts.LedgerCommitted, other, "")
	waitStarted(t, runs, other.ID)
	if started, _ := facts(runs, slow.ID); len(started) != 0 {
		t.Fatalf("the slow container started before its layer was served: %+v", started)
	}
	// Acked while it pulls: no redelivery after AckWait pulls it again.
	waitAcked(t, b, contracts.StreamAllocations, node, seq)

	reg.release()
	if r := waitEnded(t, runs, slow.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("the slow container: %+v", r)
	}
	if n := sim.launches(slow.ID); n != 1 {
		t.Fatalf("the slow container launched %d times, want once", n)
	}
	k := kinds(runs, slow.ID)
	if len(k) < 3 || k[0] != contracts.RunPulling || k[len(k)-2] != contracts.RunStarted || k[len(k)-1] != contracts.RunEnded {
		t.Fatalf("run facts %v; want pulling facts, started, ended", k)
	}
}

// TestAStopOrReleaseDuringThePullLaunchesNothing: a stop or a release of
// an allocation whose image is being pulled gives the pull up (the
// registry sees its client go) and ends the run as the stop says, with
// nothing launched, even once the layer is served.
func TestAStopOrReleaseDuringThePullLaunchesNothing(t *testing.T) {
	tests := map[string]struct {
		stop    func(t *testing.T, b *testBus, a contracts.Allocation)
		outcome contracts.RunOutcome
		reason  contracts.Reason
	}{
		"stop": {
			stop:    func(t *testing.T, b *testBus, a contracts.Allocation) { stopRun(t, b, a, time.Second) },
			outcome: contracts.OutcomeCancelled, reason: contracts.ReasonCancelled,
		},
		"release": {
			stop:    func(t *testing.T, b *testBus, a contracts.Allocation) { ledger(t, b, contracts.LedgerReleased, a, "") },
			outcome: contracts.OutcomeFailed, reason: contracts.ReasonNodeLost,
		},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			reg := newGatedRegistry(t)
			b := connect(t)
			const node = "pull-stop"
			cfg := testConfig(t, node)
			sim := newSimContainers(t)
			cfg.Runner, cfg.ImageDir = sim, t.TempDir()
			runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
			startAgent(t, b, cfg)

			a := allocation(node, "stopped", contracts.RunSpec{Image: reg.ref, Command: []string{"/bin/true"}}, 2)
			ledger(t, b, contracts.LedgerCommitted, a, "")
			await(t, "the layer asked for", reg.asked)
			tt.stop(t, b, a)
			await(t, "the pull given up", reg.gone)
			r := waitEnded(t, runs, a.ID).Result
			if r.Outcome != tt.outcome || r.Reason != tt.reason || r.ExitCode != -1 || !r.StartedAt.IsZero() {
				t.Fatalf("result %+v, want %s %s before it started", r, tt.outcome, tt.reason)
			}
			reg.release()
			// A redelivered commit, now that the layer would come, starts
			// nothing either: the ended fact guards it.
			waitAcked(t, b, contracts.StreamAllocations, node, ledger(t, b, contracts.LedgerCommitted, a, "again"))
			if n := sim.launches(a.ID); n != 0 {
				t.Fatalf("launched %d times after its stop", n)
			}
			if started, _ := facts(runs, a.ID); len(started) != 0 {
				t.Fatalf("started facts %+v", started)
			}
		})
	}
}

// TestARedeliveredCommitDuringThePullPullsOnce: the same commit delivered
// again while its image is pulled is acked with nothing done: one pull
// of the layer, one launch, one started fact.
func TestARedeliveredCommitDuringThePullPullsOnce(t *testing.T) {
	reg := newGatedRegistry(t)
	b := connect(t)
	const node = "pull-again"
	cfg := testConfig(t, node)
	sim := newSimContainers(t)
	cfg.Runner, cfg.ImageDir = sim, t.TempDir()
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	a := allocation(node, "twice", contracts.RunSpec{Image: reg.ref, Command: []string{"/bin/true"}}, 0)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	await(t, "the layer asked for", reg.asked)
	// Under another message ID, as a redelivery past JetStream's duplicate
	// window looks.
	waitAcked(t, b, contracts.StreamAllocations, node, ledger(t, b, contracts.LedgerCommitted, a, "again"))
	reg.release()
	waitEnded(t, runs, a.ID)
	if n := reg.layerRequests(); n != 1 {
		t.Fatalf("the layer was asked for %d times, want once", n)
	}
	if n := sim.launches(a.ID); n != 1 {
		t.Fatalf("launched %d times, want once", n)
	}
	if started, ended := facts(runs, a.ID); len(started) != 1 || len(ended) != 1 {
		t.Fatalf("%d started and %d ended facts, want one each", len(started), len(ended))
	}
}

// TestAnAgentThatDiedPullingIsResumedOnce: an agent SIGKILLed while it
// pulls a container's image has acked its commit (nothing redelivers
// it); the next agent resumes the run from the ledger: it pulls again
// and starts it, once.
func TestAnAgentThatDiedPullingIsResumedOnce(t *testing.T) {
	reg := newGatedRegistry(t)
	b := connect(t)
	const node = "pull-crash"
	cfg := testConfig(t, node)
	cfg.ImageDir = t.TempDir()
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))

	crash := startHelperAgent(t, b, cfg)
	a := allocation(node, "resumed", contracts.RunSpec{Image: reg.ref, Command: []string{"/bin/true"}}, 0)
	seq := ledger(t, b, contracts.LedgerCommitted, a, "")
	await(t, "the layer asked for", reg.asked)
	waitAcked(t, b, contracts.StreamAllocations, node, seq)
	crash()
	await(t, "the dead agent's pull gone", reg.gone)
	if _, err := os.Stat(stateDir(cfg, a.ID)); !os.IsNotExist(err) {
		t.Fatalf("the dead agent launched the run before its image was pulled: %v", err)
	}
	reg.release()

	sim := newSimContainers(t)
	cfg.Runner = sim
	startAgentAfterCrash(t, b, cfg, inv, len(inv.all()))
	if r := waitEnded(t, runs, a.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("the resumed container: %+v", r)
	}
	// Its commit delivered again (as to an agent with a fresh durable)
	// starts nothing more.
	waitAcked(t, b, contracts.StreamAllocations, node, ledger(t, b, contracts.LedgerCommitted, a, "again"))
	if n := sim.launches(a.ID); n != 1 {
		t.Fatalf("launched %d times, want once", n)
	}
	if started, ended := facts(runs, a.ID); len(started) != 1 || len(ended) != 1 {
		t.Fatalf("%d started and %d ended facts, want one each", len(started), len(ended))
	}
}

// refusingOnce is simContainers whose first launch of each container
// says a run was launched already, when none was: the agent's adoption
// then fails, as a publish to a bus that is away does.
type refusingOnce struct {
	*simContainers
	mu      sync.Mutex
	refused map[string]bool
}

func (r *refusingOnce) Launch(ctx context.Context, l runner.Launch) (runner.Process, error) {
	r.mu.Lock()
	first := l.Container != nil && !r.refused[l.AllocationID]
	r.refused[l.AllocationID] = true
	r.mu.Unlock()
	if first {
		return nil, fmt.Errorf("%s: %w", l.AllocationID, runner.ErrAlreadyLaunched)
	}
	return r.simContainers.Launch(ctx, l)
}

// TestAContainerLaunchThatFailsIsTriedAgain: a container's commit is
// acked before its launch, so a launch that fails for a reason of the
// moment is tried again by the agent itself (nothing redelivers it): the
// run starts once, and its entry delivered again meanwhile does nothing.
func TestAContainerLaunchThatFailsIsTriedAgain(t *testing.T) {
	reg := newGatedRegistry(t)
	reg.release()
	b := connect(t)
	const node = "pull-retry"
	cfg := testConfig(t, node)
	r := &refusingOnce{simContainers: newSimContainers(t), refused: map[string]bool{}}
	cfg.Runner, cfg.ImageDir = r, t.TempDir()
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	startAgent(t, b, cfg)

	a := allocation(node, "retried", contracts.RunSpec{Image: reg.ref, Command: []string{"/bin/true"}}, 0)
	ledger(t, b, contracts.LedgerCommitted, a, "")
	if res := waitEnded(t, runs, a.ID).Result; res.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("result %+v", res)
	}
	waitAcked(t, b, contracts.StreamAllocations, node, ledger(t, b, contracts.LedgerCommitted, a, "again"))
	if n := r.launches(a.ID); n != 1 {
		t.Fatalf("launched %d times, want once", n)
	}
	if started, ended := facts(runs, a.ID); len(started) != 1 || len(ended) != 1 {
		t.Fatalf("%d started and %d ended facts, want one each", len(started), len(ended))
	}
}
