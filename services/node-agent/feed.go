package nodeagent

import (
	"context"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Feed is where an agent reads what is addressed to its node: the history
// it rebuilds from at start (gp.runs.<node>, gp.alloc.ledger.<node>,
// gp.cmd.node.<node>) and the live ledger entries and commands it acts on.
//
// A standalone agent reads the bus itself: an ordered replay per subject
// and a durable consumer per stream, named after its node (NewBusFeed). A
// fleet of simulated agents in one process shares one replay and one
// durable consumer per stream among all of its machines instead, because
// JetStream caps consumers per stream (1,000 by default) and each costs
// the server memory and heartbeats; the agent cannot tell the two apart.
type Feed interface {
	// Replay calls fn for every message of subject that stream holds now,
	// in stream order, until fn fails.
	Replay(ctx context.Context, stream, subject string, fn func(context.Context, *bus.Msg) error) error
	// Consume calls h for every message of subject in stream that this
	// node's agent has not yet acknowledged, and for each new one, in
	// stream order with bus.Handler's contract (nil acks, a permanent
	// error dead-letters, any other error redelivers), until ctx ends; it
	// returns nil then. The ctx given to h ends no later than ctx.
	Consume(ctx context.Context, stream, subject string, h bus.Handler) error
}

// NewBusFeed returns the Feed of a standalone agent of node nodeID: it
// reads the bus directly, with one durable consumer per stream, both named
// after the node (they are on different streams), so a restarted agent
// resumes where it stopped. inactive, when
// above 0, lets the server remove the consumers once no agent has read
// them for that long: a machine created at run time is not coming back
// after it is deleted, and its consumers would otherwise stay for good. 0
// keeps them.
func NewBusFeed(b *bus.Bus, nodeID string, inactive time.Duration) Feed {
	// The name is the one a node identity may use (contracts.Access).
	return busFeed{bus: b, durable: contracts.NodeConsumer(nodeID), node: nodeID, inactive: inactive, replays: &replayLocks{}}
}

type busFeed struct {
	bus      *bus.Bus
	durable  string
	node     string
	replays  *replayLocks
	inactive time.Duration
}

var _ Feed = busFeed{}

func (f busFeed) Replay(ctx context.Context, stream, subject string, fn func(context.Context, *bus.Msg) error) error {
	// Replays of one stream share the node's replay consumer names
	// (contracts.NodeReplayPrefix), so they take turns.
	mu := f.replays.stream(stream)
	mu.Lock()
	defer mu.Unlock()
	_, err := f.bus.Replay(ctx, bus.FollowSpec{Stream: stream, FilterSubjects: []string{subject},
		NamePrefix: contracts.NodeReplayPrefix(f.node)}, fn)
	return err
}

// replayLocks serialises an agent's replays per stream.
type replayLocks struct {
	mu sync.Mutex
	m  map[string]*sync.Mutex
}

func (l *replayLocks) stream(name string) *sync.Mutex {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]*sync.Mutex{}
	}
	if l.m[name] == nil {
		l.m[name] = &sync.Mutex{}
	}
	return l.m[name]
}

func (f busFeed) Consume(ctx context.Context, stream, subject string, h bus.Handler) error {
	return f.bus.Consume(ctx, bus.ConsumerSpec{Stream: stream, Durable: f.durable, FilterSubjects: []string{subject},
		InactiveThreshold: f.inactive}, h)
}
