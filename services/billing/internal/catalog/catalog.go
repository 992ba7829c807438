// Package catalog is what billing reads to price usage, each from the bus:
// the price book and the metering watermark (KV bucket gp-pricebook), the
// nodes' price classes and GPU memory (the NODES inventories) and the jobs'
// CPU and memory requests (their queued events in JOB_EVENTS).
package catalog

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/billing/internal/meter"
)

// Book reads the price book from its KV bucket. Get reads the key at every
// call (one round trip, the value is parsed only when its revision
// changed), so a release is always priced with the book as it is when the
// release is metered, never with a copy a watcher has not refreshed yet.
type Book struct {
	kv jetstream.KeyValue

	mu   sync.Mutex
	rev  uint64
	book contracts.PriceBook
}

// NewBook reads the book in kv.
func NewBook(kv jetstream.KeyValue) *Book { return &Book{kv: kv} }

// Get returns the current book (empty when none was ever set).
func (b *Book) Get(ctx context.Context) (contracts.PriceBook, error) {
	e, err := b.kv.Get(ctx, contracts.KeyPriceBook)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return contracts.PriceBook{}, nil
	case err != nil:
		return contracts.PriceBook{}, fmt.Errorf("read the price book: %w", err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if e.Revision() == b.rev {
		return b.book, nil
	}
	book, err := contracts.DecodePriceBook(e.Value())
	if err != nil {
		// Writers validate before they write: this is a bug or a hand
		// edit, and billing must not guess prices. Metering waits.
		return contracts.PriceBook{}, fmt.Errorf("the price book at revision %d is invalid: %w", e.Revision(), err)
	}
	b.rev, b.book = e.Revision(), book
	return book, nil
}

// Watermark is the end of the latest usage billing metered, kept in the
// price book's bucket so that an edit of the book can refuse to reach
// back over it. Billing is its only writer.
type Watermark struct {
	kv  jetstream.KeyValue
	log *slog.Logger

	mu  sync.Mutex
	cur time.Time
}

// NewWatermark reads the watermark in kv.
func NewWatermark(kv jetstream.KeyValue, log *slog.Logger) *Watermark {
	return &Watermark{kv: kv, log: log}
}

// ReadWatermark returns the watermark stored in kv (zero when none).
func ReadWatermark(ctx context.Context, kv jetstream.KeyValue) (time.Time, error) {
	e, err := kv.Get(ctx, contracts.KeyMeteredUntil)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		return time.Time{}, nil
	case err != nil:
		return time.Time{}, fmt.Errorf("read the metering watermark: %w", err)
	}
	t, err := time.Parse(time.RFC3339, string(e.Value()))
	if err != nil {
		return time.Time{}, fmt.Errorf("metering watermark %q: %w", e.Value(), err)
	}
	return t, nil
}

// Advance moves the watermark to t when t is later. A failure is logged,
// not returned: the records are published, and the next release moves it.
func (w *Watermark) Advance(ctx context.Context, t time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !t.After(w.cur) {
		return
	}
	if _, err := w.kv.Put(ctx, contracts.KeyMeteredUntil, []byte(t.UTC().Format(time.RFC3339))); err != nil {
		w.log.Warn("metering watermark not advanced", "to", t, "err", err)
		return
	}
	w.cur = t
}

// Init sets the watermark known at start (the later of the stored one and
// the end of the last record in USAGE) and stores it.
func (w *Watermark) Init(ctx context.Context, t time.Time) error {
	stored, err := ReadWatermark(ctx, w.kv)
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.cur = stored
	w.mu.Unlock()
	w.Advance(ctx, t)
	return nil
}

// Nodes follows the node inventories: the latest of each node says its
// pool, price class and GPU memory.
type Nodes struct {
	bus *bus.Bus
	log *slog.Logger

	mu    sync.RWMutex
	nodes map[string]meter.Node
	ready chan struct{}
}

// NewNodes returns an empty view; Run fills it.
func NewNodes(b *bus.Bus, log *slog.Logger) *Nodes {
	return &Nodes{bus: b, log: log, nodes: map[string]meter.Node{}, ready: make(chan struct{})}
}

// Ready is closed once the inventories present at start are read.
func (n *Nodes) Ready() <-chan struct{} { return n.ready }

// Run follows NODES until ctx ends.
func (n *Nodes) Run(ctx context.Context) error {
	var once sync.Once
	for ctx.Err() == nil {
		err := n.bus.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamNodes, FilterSubjects: []string{contracts.SubjectInventoryAll},
			LastPerSubject: true}, n.apply, func() { once.Do(func() { close(n.ready) }) })
		if ctx.Err() != nil {
			return nil
		}
		n.log.Warn("following node inventories interrupted; again", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	return nil
}

func (n *Nodes) apply(_ context.Context, m *bus.Msg) error {
	var inv contracts.NodeInventory
	if err := m.Decode(&inv); err != nil || inv.NodeID == "" {
		n.log.Warn("skipping unreadable inventory", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		return nil
	}
	node := meter.Node{Pool: inv.Pool, Class: contracts.PriceClassOf(inv.PriceClass), GPUMemoryMiB: map[string]int64{}}
	for _, g := range inv.GPUs {
		node.GPUMemoryMiB[g.UUID] = g.MemoryMiB
	}
	n.mu.Lock()
	n.nodes[inv.NodeID] = node
	n.mu.Unlock()
	return nil
}

// Node returns what the latest inventory of id says, false when none came.
func (n *Nodes) Node(id string) (meter.Node, bool) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	node, ok := n.nodes[id]
	return node, ok
}

// SpotPools are the pools whose every known node is spot, sorted.
func (n *Nodes) SpotPools() []string {
	n.mu.RLock()
	defer n.mu.RUnlock()
	spot := map[string]bool{}
	for _, node := range n.nodes {
		if node.Pool == "" {
			continue
		}
		if ok, seen := spot[node.Pool]; !seen || ok {
			spot[node.Pool] = node.Class == contracts.PriceSpot
		}
	}
	var out []string
	for p, ok := range spot {
		if ok {
			out = append(out, p)
		}
	}
	slices.Sort(out)
	return out
}

// Requests finds what a job requested in its queued event, the first
// event on its JOB_EVENTS subject (a direct get, no consumer).
type Requests struct {
	js jetstream.JetStream
}

// NewRequests reads from js.
func NewRequests(js jetstream.JetStream) *Requests { return &Requests{js: js} }

// Resources returns the job's requested milli-CPU and host memory, zero
// when the job has no queued event (or asked for none).
func (r *Requests) Resources(ctx context.Context, tenant, jobID string) (cpuMilli, memoryMiB int64, err error) {
	s, err := r.js.Stream(ctx, contracts.StreamJobEvents)
	if err != nil {
		return 0, 0, fmt.Errorf("job events stream: %w", err)
	}
	msg, err := s.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(contracts.SubjectJobEvents(tenant, jobID)))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, 0, nil
	case err != nil:
		return 0, 0, fmt.Errorf("first event of %s/%s: %w", tenant, jobID, err)
	}
	var ev contracts.JobEvent
	if err := json.Unmarshal(msg.Data, &ev); err != nil || ev.Request == nil {
		return 0, 0, nil
	}
	return ev.Request.Resources.CPUMilli, ev.Request.Resources.MemoryMiB, nil
}
