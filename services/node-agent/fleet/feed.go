package fleet

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

// sharedFeed is the nodeagent.Feed of every agent of one fleet. A
// standalone agent replays three subjects at start and keeps two durable
// consumers; 2,000 of them would make 6,000 replays and 4,000 consumers,
// past JetStream's default of 1,000 consumers per stream. The fleet
// instead replays each stream once and keeps one durable consumer per
// stream, handing every message to the agent of the node its subject
// names:
//
//	RUNS, ALLOCATIONS, NODE_COMMANDS ─ one replay each at start ─▶ history per subject ─▶ each agent's rebuild
//	ALLOCATIONS   gp.alloc.ledger.* ─ one durable, keyed workers ─▶ agent of <node>: onLedger
//	NODE_COMMANDS gp.cmd.node.*     ─ one durable, keyed workers ─▶ agent of <node>: onCommand
//
// What an agent sees is what its own consumers would show it: a subject's
// messages one at a time in stream order (workers are keyed by subject),
// different nodes in parallel, and no message before the agent has
// rebuilt (the consumers start once every agent has subscribed). The
// start history is a snapshot taken before any agent runs; whatever comes
// after it is delivered by the consumers, which start from their own
// acknowledged position, so nothing falls between the two.
type sharedFeed struct {
	bus     *bus.Bus
	log     *slog.Logger
	durable string
	nodes   map[string]bool

	mu       sync.Mutex
	loaded   map[string]bool        // streams whose start history was read
	history  map[feedKey][]*bus.Msg // start history per subject, until its agent reads it
	replayed map[feedKey]bool       // subjects whose start history was handed out
	routes   map[feedKey]feedRoute  // the agent consuming each subject
	expected map[feedKey]bool       // subjects no agent has subscribed to yet
	ready    chan struct{}          // closed once expected is empty
}

type feedKey struct{ stream, subject string }

// feedRoute is one agent's handler and the context of its consumer.
type feedRoute struct {
	ctx context.Context
	h   bus.Handler
}

// feedWorkers is how many workers handle a stream's messages in
// parallel, keyed by subject: one per two machines, from 16 to 256. A
// handler is short (a simulated launch) but waits on the bus for its
// started fact's ack, and real machines each have their own consumer:
// the simulated fleet must not queue starts that real agents would make
// at once. With 16 workers for 320 machines, BenchmarkSteadyLoad's runs
// waited 0.8-1.5 s (p50) between commit and start on a quiet machine;
// with 160, 0.12-0.16 s.
func feedWorkers(machines int) int { return min(max(machines/2, 16), 256) }

// feedInactive removes the durables of a fleet that no longer runs: their
// names follow the fleet's machines, so a changed fleet gets new ones.
const feedInactive = 24 * time.Hour

// replayed are the streams whose history an agent rebuilds from;
// consumed are the streams an agent consumes, with the subjects of all
// nodes.
var (
	replayedStreams = []struct{ stream, all string }{
		{contracts.StreamRuns, contracts.SubjectRunsAll},
		{contracts.StreamAllocations, contracts.SubjectLedgerAll},
		{contracts.StreamNodeCommands, contracts.SubjectNodeCommandsAll},
	}
	consumedStreams = []struct {
		stream, all string
		subject     func(node string) string
	}{
		{contracts.StreamAllocations, contracts.SubjectLedgerAll, contracts.SubjectLedger},
		{contracts.StreamNodeCommands, contracts.SubjectNodeCommandsAll, contracts.SubjectNodeCommands},
	}
)

var _ nodeagent.Feed = (*sharedFeed)(nil)

// newSharedFeed is the feed of a fleet of the given machines. Its durable
// consumers are named after the set of machines, so the same fleet started
// again carries on where it stopped, and two different fleets on one bus
// never take each other's messages.
func newSharedFeed(b *bus.Bus, log *slog.Logger, nodes []string) *sharedFeed {
	f := &sharedFeed{
		bus: b, log: log, durable: durableName(nodes), nodes: map[string]bool{},
		loaded: map[string]bool{}, history: map[feedKey][]*bus.Msg{}, replayed: map[feedKey]bool{},
		routes: map[feedKey]feedRoute{}, expected: map[feedKey]bool{}, ready: make(chan struct{}),
	}
	for _, n := range nodes {
		f.nodes[n] = true
		for _, c := range consumedStreams {
			f.expected[feedKey{c.stream, c.subject(n)}] = true
		}
	}
	if len(f.expected) == 0 {
		close(f.ready)
	}
	return f
}

func durableName(nodes []string) string {
	h := fnv.New64a()
	for _, n := range slices.Sorted(slices.Values(nodes)) {
		h.Write([]byte(n))
		h.Write([]byte{0})
	}
	return "node-agent-fleet-" + strconv.FormatUint(h.Sum64(), 36)
}

// nodeOf is the node token of a per-node subject (its last token).
func nodeOf(subject string) string { return subject[strings.LastIndexByte(subject, '.')+1:] }

// loadHistory reads what RUNS, ALLOCATIONS and NODE_COMMANDS hold now for
// the fleet's machines: one ordered replay per stream.
func (f *sharedFeed) loadHistory(ctx context.Context) error {
	for _, s := range replayedStreams {
		var kept int
		_, err := f.bus.Replay(ctx, bus.FollowSpec{Stream: s.stream, FilterSubjects: []string{s.all}},
			func(_ context.Context, m *bus.Msg) error {
				if f.nodes[nodeOf(m.Subject)] {
					k := feedKey{s.stream, m.Subject}
					f.mu.Lock()
					f.history[k] = append(f.history[k], m)
					f.mu.Unlock()
					kept++
				}
				return nil
			})
		if err != nil {
			return fmt.Errorf("fleet: replay %s: %w", s.stream, err)
		}
		f.mu.Lock()
		f.loaded[s.stream] = true
		f.mu.Unlock()
		f.log.Debug("fleet history read", "stream", s.stream, "messages", kept)
	}
	return nil
}

// Replay hands an agent the start history of its subject the first time it
// asks; later replays (an agent checking its facts again after a
// redelivery) read the stream as it is now.
func (f *sharedFeed) Replay(ctx context.Context, stream, subject string, fn func(context.Context, *bus.Msg) error) error {
	k := feedKey{stream, subject}
	f.mu.Lock()
	fromStart := f.loaded[stream] && f.nodes[nodeOf(subject)] && !f.replayed[k]
	msgs := f.history[k]
	if fromStart {
		f.replayed[k] = true
		delete(f.history, k)
	}
	f.mu.Unlock()
	if !fromStart {
		_, err := f.bus.Replay(ctx, bus.FollowSpec{Stream: stream, FilterSubjects: []string{subject}}, fn)
		return err
	}
	for _, m := range msgs {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(ctx, m); err != nil {
			return err
		}
	}
	return nil
}

// Consume routes subject's messages to h until ctx ends.
func (f *sharedFeed) Consume(ctx context.Context, stream, subject string, h bus.Handler) error {
	k := feedKey{stream, subject}
	f.mu.Lock()
	if _, taken := f.routes[k]; taken {
		f.mu.Unlock()
		return fmt.Errorf("fleet: %s of %s is already consumed by another agent", subject, stream)
	}
	f.routes[k] = feedRoute{ctx: ctx, h: h}
	f.arrivedLocked(k)
	f.mu.Unlock()
	<-ctx.Done()
	f.mu.Lock()
	delete(f.routes, k)
	f.mu.Unlock()
	return nil
}

// stopped notes that the agent of node has stopped: the consumers need not
// wait for it.
func (f *sharedFeed) stopped(node string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range consumedStreams {
		f.arrivedLocked(feedKey{c.stream, c.subject(node)})
	}
}

func (f *sharedFeed) arrivedLocked(k feedKey) {
	if !f.expected[k] {
		return
	}
	delete(f.expected, k)
	if len(f.expected) == 0 {
		close(f.ready)
	}
}

// run starts the shared consumers once every agent has subscribed (or
// stopped) and runs them until ctx ends.
func (f *sharedFeed) run(ctx context.Context) error {
	select {
	case <-f.ready:
	case <-ctx.Done():
		return nil
	}
	f.mu.Lock()
	history := len(f.history) // subjects whose agent never read its start history
	f.mu.Unlock()
	f.log.Info("fleet consumers starting", "durable", f.durable, "machines", len(f.nodes), "unread_histories", history)
	g, gctx := errgroup.WithContext(ctx)
	for _, c := range consumedStreams {
		g.Go(func() error {
			return f.bus.Consume(gctx, bus.ConsumerSpec{Stream: c.stream, Durable: f.durable,
				FilterSubjects: []string{c.all}, Workers: feedWorkers(len(f.nodes)), InactiveThreshold: feedInactive,
			}, f.dispatch(c.stream))
		})
	}
	return g.Wait()
}

// errNoAgent is the transient error of a message for a machine whose
// agent is not running: it is redelivered with the consumer's backoff,
// and dead-lettered after MaxDeliver like any message its agent could not
// handle.
var errNoAgent = errors.New("the node's agent is not running")

// dispatch hands each message of stream to the agent of its node, in that
// agent's context (its lifetime) and the message's trace.
func (f *sharedFeed) dispatch(stream string) bus.Handler {
	return func(ctx context.Context, m *bus.Msg) error {
		n := nodeOf(m.Subject)
		if !f.nodes[n] {
			// Another fleet's machine or a real one: this durable is the
			// fleet's own, so leaving it alone means acknowledging it.
			return nil
		}
		f.mu.Lock()
		r, ok := f.routes[feedKey{stream, m.Subject}]
		f.mu.Unlock()
		if !ok {
			return fmt.Errorf("%s: %w", n, errNoAgent)
		}
		return r.h(trace.ContextWithSpan(r.ctx, trace.SpanFromContext(ctx)), m)
	}
}

// nodeIDs lists the node IDs of cfgs.
func nodeIDs(cfgs []nodeagent.Config) []string {
	ids := make(map[string]bool, len(cfgs))
	for _, c := range cfgs {
		ids[c.NodeID] = true
	}
	return slices.Sorted(maps.Keys(ids))
}
