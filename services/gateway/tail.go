package gateway

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// The event streams (sse.go) are served from one shared tail of JOB_EVENTS
// per gateway process instead of one JetStream consumer per HTTP
// subscriber: 500 subscribers each replaying a tenant's history from the
// server took 13 to 20 s to see a live event, and 687 MB (issue 17).
//
//	JOB_EVENTS ──the read model's ordered read (ingest.go)──▶ eventTail ──┬─ ring: the last RingEvents/RingBytes events, indexed by tenant and job
//	                                                                      └─ fan-out ──▶ each subscriber's bounded queue ──▶ its HTTP stream
//	JOB_EVENTS ──short-lived consumer, one batch, HistoryReaders at once──▶ a subscriber whose history is older than the ring
//
// A subscriber asks for the events of its filter after a stream sequence
// (from). Under the tail's lock, when the ring holds every event after from
// (from >= covered), it takes the ring's matching events and registers for
// the live ones in one step: every event is then in the snapshot or in its
// queue, never both and never neither (the handover is by stream sequence).
// Otherwise it reads (from, covered] from the stream in bounded batches,
// each on a consumer of its own that is deleted before the batch is sent,
// and tries again. A subscriber whose queue is full is cut from the live
// tail (its queue is closed): it sends what its queue holds and catches up
// again from the ring or the stream, so a slow subscriber never stalls the
// tail or anyone else.

// SSEConfig sizes the shared tail the job event streams are served from.
// Zero fields take the defaults of DefaultSSEConfig.
type SSEConfig struct {
	// RingEvents and RingBytes bound the ring of the most recent job
	// events the tail keeps in memory (a subscriber whose history starts
	// in the ring is served without touching the stream).
	RingEvents int
	RingBytes  int64
	// QueueEvents bounds each subscriber's queue of live events; one that
	// falls that far behind leaves the live tail and catches up.
	QueueEvents int
	// HistoryReaders bounds the subscribers reading history older than
	// the ring from the stream at once (each on a consumer of its own for
	// one batch of HistoryBatch events).
	HistoryReaders int
	HistoryBatch   int
	// PerSubscriberConsumers serves every stream from a consumer of its
	// own, the way it was before the shared tail: a baseline for
	// BenchmarkSSEFanout, not a flag.
	PerSubscriberConsumers bool
}

// DefaultSSEConfig keeps about 32 MiB of recent events: at about 600 bytes
// an event, the whole ring of 50,000 events.
func DefaultSSEConfig() SSEConfig {
	return SSEConfig{RingEvents: 50_000, RingBytes: 32 << 20, QueueEvents: 1024, HistoryReaders: 16, HistoryBatch: 512}
}

func (c SSEConfig) withDefaults() SSEConfig {
	d := DefaultSSEConfig()
	c.RingEvents = cmp.Or(c.RingEvents, d.RingEvents)
	c.RingBytes = cmp.Or(c.RingBytes, d.RingBytes)
	c.QueueEvents = cmp.Or(c.QueueEvents, d.QueueEvents)
	c.HistoryReaders = cmp.Or(c.HistoryReaders, d.HistoryReaders)
	c.HistoryBatch = cmp.Or(c.HistoryBatch, d.HistoryBatch)
	return c
}

// validate reports every negative size.
func (c SSEConfig) validate() error {
	var errs []error
	for _, f := range []struct {
		name string
		v    int64
	}{{"sse ring events", int64(c.RingEvents)}, {"sse ring bytes", c.RingBytes}, {"sse queue events", int64(c.QueueEvents)},
		{"sse history readers", int64(c.HistoryReaders)}, {"sse history batch", int64(c.HistoryBatch)}} {
		if f.v < 0 {
			errs = append(errs, fmt.Errorf("%s is %d; want > 0 (0: the default)", f.name, f.v))
		}
	}
	return errors.Join(errs...)
}

func (c *SSEConfig) registerFlags(fs *flag.FlagSet) {
	fs.IntVar(&c.RingEvents, "sse-ring-events", c.RingEvents, "recent job events kept in memory for event streams")
	fs.Int64Var(&c.RingBytes, "sse-ring-bytes", c.RingBytes, "bytes of recent job events kept in memory for event streams")
	fs.IntVar(&c.QueueEvents, "sse-queue-events", c.QueueEvents, "live events an event stream may fall behind before it catches up from the ring or the stream")
	fs.IntVar(&c.HistoryReaders, "sse-history-readers", c.HistoryReaders, "event streams reading history older than the ring from JetStream at once")
}

// tailEventOverhead is what a ring entry costs beside its frame: the
// struct, its index slots and map entries (an estimate, for RingBytes).
const tailEventOverhead = 160

// tailEvent is one job event as every subscriber sends it. It is shared
// by the ring and the queues and never changed once built.
type tailEvent struct {
	seq     uint64
	subject string
	// tenant is the subject's tenant token; plain says the subject is
	// gp.jobs.events.<tenant>.<job>, what a tenant's filter matches.
	tenant string
	plain  bool
	// bodyTenant is the event's own Tenant field.
	bodyTenant string
	// frame is the server-sent event: event, id and data lines; data is
	// the compact JSON inside it.
	frame []byte
	data  []byte
}

func (e *tailEvent) size() int64 { return int64(len(e.frame)+len(e.subject)) + tailEventOverhead }

// decode returns the event: each call a copy of its own.
func (e *tailEvent) decode() (contracts.JobEvent, error) {
	var ev contracts.JobEvent
	err := json.Unmarshal(e.data, &ev)
	return ev, err
}

// parseTailEvent builds the frame of one JOB_EVENTS message, or says why
// it cannot be sent (it is then skipped, as it always was).
func parseTailEvent(subject string, seq uint64, data []byte) (*tailEvent, error) {
	var ev contracts.JobEvent
	if err := json.Unmarshal(data, &ev); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	return buildTailEvent(subject, seq, data, ev.Type, ev.Tenant)
}

// buildTailEvent builds the frame of one JOB_EVENTS message whose body was
// decoded already (the read model's fold decodes every event once for
// both: ingest.go), given the body's type and tenant.
func buildTailEvent(subject string, seq uint64, data []byte, typ contracts.JobEventType, bodyTenant string) (*tailEvent, error) {
	if typ == "" || strings.ContainsAny(string(typ), "\r\n") {
		return nil, fmt.Errorf("event type %q cannot be sent", typ)
	}
	var buf bytes.Buffer
	buf.Grow(len(data) + len(typ) + 40)
	buf.WriteString("event: ")
	buf.WriteString(string(typ))
	buf.WriteString("\nid: ")
	buf.WriteString(strconv.FormatUint(seq, 10))
	buf.WriteString("\ndata: ")
	start := buf.Len()
	if isCompact(data) {
		// What encoding/json writes, as every producer does: Compact
		// would copy it unchanged, at several times the cost of the
		// check.
		buf.Write(data)
	} else if err := json.Compact(&buf, data); err != nil {
		return nil, fmt.Errorf("compact: %w", err)
	}
	end := buf.Len()
	buf.WriteString("\n\n")
	frame := buf.Bytes()
	tenant, plain := subjectTenant(subject)
	return &tailEvent{seq: seq, subject: subject, tenant: tenant, plain: plain, bodyTenant: bodyTenant,
		frame: frame, data: frame[start:end:end]}, nil
}

// isCompact says whether data, a JSON document (decoded as one already),
// has no whitespace outside its strings and no line break at all: what
// json.Compact would return unchanged, and one line of an event stream.
// Anything else (a line break inside a string that a lenient decoder
// let through included) goes through json.Compact, as it always did.
func isCompact(data []byte) bool {
	inString := false
	for i := 0; i < len(data); i++ {
		switch c := data[i]; {
		case c == '\n' || c == '\r':
			return false
		case inString && c == '\\':
			i++ // the escaped byte: never a quote that ends the string
		case c == '"':
			inString = !inString
		case !inString && (c == ' ' || c == '\t'):
			return false
		}
	}
	return true
}

// subjectTenant returns a job event subject's tenant token (the fourth,
// gp.jobs.events.<tenant>...) and whether the subject is
// gp.jobs.events.<tenant>.<job>, what a tenant's filter matches, without
// splitting it.
func subjectTenant(subject string) (tenant string, plain bool) {
	tokens := 1 + strings.Count(subject, ".")
	rest := subject
	for range 3 {
		i := strings.IndexByte(rest, '.')
		if i < 0 {
			return "", false
		}
		rest = rest[i+1:]
	}
	if i := strings.IndexByte(rest, '.'); i >= 0 {
		rest = rest[:i]
	}
	return rest, tokens == 5
}

// eventFilter is what one stream sends: a tenant's events, or one job's.
type eventFilter struct {
	// subject is the JetStream filter of the same events.
	subject string
	tenant  string
	// job is empty for a tenant's stream.
	job string
}

func tenantFilter(tenant string) eventFilter {
	return eventFilter{subject: contracts.SubjectTenantJobEvents(tenant), tenant: tenant}
}

func jobFilter(tenant, job string) eventFilter {
	return eventFilter{subject: contracts.SubjectJobEvents(tenant, job), tenant: tenant, job: job}
}

func (f eventFilter) matches(e *tailEvent) bool {
	if f.job != "" {
		return e.subject == f.subject
	}
	return e.plain && e.tenant == f.tenant
}

// seqList is events in stream order: pushed at the back, popped at the
// front (the ring evicts its oldest first, so each index does too).
type seqList struct {
	evs  []*tailEvent
	head int
}

func (l *seqList) len() int { return len(l.evs) - l.head }

func (l *seqList) push(e *tailEvent) { l.evs = append(l.evs, e) }

func (l *seqList) front() *tailEvent { return l.evs[l.head] }

func (l *seqList) popFront() {
	l.evs[l.head] = nil
	l.head++
	if l.head >= 32 && l.head*2 >= len(l.evs) {
		// Move the live part down so the slice does not grow forever.
		n := copy(l.evs, l.evs[l.head:])
		clear(l.evs[n:])
		l.evs, l.head = l.evs[:n], 0
	}
}

// after returns a copy of the first n events after seq.
func (l *seqList) after(seq uint64, n int) []*tailEvent {
	live := l.evs[l.head:]
	i := sort.Search(len(live), func(i int) bool { return live[i].seq > seq })
	return append([]*tailEvent(nil), live[i:min(len(live), i+n)]...)
}

// tailSub is one subscriber registered for live events.
type tailSub struct {
	f     eventFilter
	queue chan *tailEvent
}

// eventTail follows JOB_EVENTS for every event stream of the process.
type eventTail struct {
	bus *bus.Bus
	// js reads history (readBatch): bus's, or a test's that injects a
	// lagging server's counts.
	js  jetstream.JetStream
	cfg SSEConfig
	log *slog.Logger
	// history is a semaphore: a slot per reader of the stream at once.
	history chan struct{}
	ready   chan struct{}

	mu sync.Mutex
	// ring holds every sendable event with a sequence in (covered, last]:
	// last is the last message the tail read, covered the last one
	// evicted (or where the tail started).
	ring          seqList
	byTenant      map[string]*seqList
	bySubject     map[string]*seqList
	bytes         int64
	covered, last uint64
	isReady       bool
	tenantSubs    map[string]map[*tailSub]struct{}
	jobSubs       map[string]map[*tailSub]struct{}
	// cut counts subscribers cut from the live tail for a full queue.
	cut int
}

func newEventTail(b *bus.Bus, cfg SSEConfig, log *slog.Logger) *eventTail {
	cfg = cfg.withDefaults()
	return &eventTail{bus: b, js: b.JetStream(), cfg: cfg, log: log, history: make(chan struct{}, cfg.HistoryReaders), ready: make(chan struct{}),
		byTenant: map[string]*seqList{}, bySubject: map[string]*seqList{},
		tenantSubs: map[string]map[*tailSub]struct{}{}, jobSubs: map[string]map[*tailSub]struct{}{}}
}

// startSeq is where the tail starts: RingEvents messages before the
// stream's end, so that the ring is full once the tail caught up.
func (t *eventTail) startSeq(ctx context.Context) (uint64, error) {
	for {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var info *jetstream.StreamInfo
		st, err := t.bus.JetStream().Stream(sctx, contracts.StreamJobEvents)
		if err == nil {
			info, err = st.Info(sctx)
		}
		cancel()
		if err == nil {
			last, n := info.State.LastSeq, uint64(t.cfg.RingEvents)
			if last < n {
				return 1, nil
			}
			return max(last-n+1, info.State.FirstSeq, 1), nil
		}
		t.log.Warn("job event tail cannot read its stream; trying again", "stream", contracts.StreamJobEvents, "err", err)
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

func (t *eventTail) caughtUp() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.isReady {
		t.isReady = true
		close(t.ready)
		t.log.Info("job event tail caught up", "stream", contracts.StreamJobEvents, "stream_seq", t.last, "ring_events", t.ring.len())
	}
}

// startAt sets where the tail's read starts when another reader feeds it
// (the read model's fold, ingest.go): the ring covers every event before
// seq, as none of them will come.
func (t *eventTail) startAt(seq uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.covered, t.last = seq-1, seq-1
}

// wants says whether the message at seq is one the tail has not read yet
// (a read that started again, or earlier than the tail for the read model,
// brings older ones): the frame of one it does not want is not built.
func (t *eventTail) wants(seq uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return seq > t.last
}

// add adds the event read at seq (e, or perr saying why it cannot be
// sent) to the ring and hands it to the subscribers it matches. It never
// blocks on a subscriber.
func (t *eventTail) add(subject string, seq uint64, e *tailEvent, perr error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if seq <= t.last {
		return // read again after a restart
	}
	t.last = seq
	if perr != nil {
		// Never sendable: the ring covers its sequence without it.
		t.log.Warn("event streams skip a malformed job event", "subject", subject, "stream_seq", seq, "err", perr)
		return
	}
	t.ring.push(e)
	t.index(t.bySubject, e.subject).push(e)
	if e.plain {
		t.index(t.byTenant, e.tenant).push(e)
	}
	t.bytes += e.size()
	for t.ring.len() > 1 && (t.ring.len() > t.cfg.RingEvents || t.bytes > t.cfg.RingBytes) {
		t.evict()
	}
	if e.plain {
		t.fanOut(t.tenantSubs[e.tenant], e)
	}
	t.fanOut(t.jobSubs[e.subject], e)
}

func (t *eventTail) index(m map[string]*seqList, key string) *seqList {
	l := m[key]
	if l == nil {
		l = &seqList{}
		m[key] = l
	}
	return l
}

// evict drops the oldest event: it is the first of its indexes too.
func (t *eventTail) evict() {
	old := t.ring.front()
	t.ring.popFront()
	t.bytes -= old.size()
	t.covered = old.seq
	drop := func(m map[string]*seqList, key string) {
		if l := m[key]; l != nil && l.len() > 0 && l.front() == old {
			l.popFront()
			if l.len() == 0 {
				delete(m, key)
			}
		}
	}
	drop(t.bySubject, old.subject)
	if old.plain {
		drop(t.byTenant, old.tenant)
	}
}

func (t *eventTail) fanOut(subs map[*tailSub]struct{}, e *tailEvent) {
	for sub := range subs {
		select {
		case sub.queue <- e:
		default:
			// Full: cut it loose rather than wait. It sends what its
			// queue holds, then catches up from the ring or the stream.
			t.removeLocked(sub)
			close(sub.queue)
			t.cut++
		}
	}
}

func (t *eventTail) subs(f eventFilter) map[string]map[*tailSub]struct{} {
	if f.job != "" {
		return t.jobSubs
	}
	return t.tenantSubs
}

func (f eventFilter) key() string {
	if f.job != "" {
		return f.subject
	}
	return f.tenant
}

func (t *eventTail) removeLocked(sub *tailSub) {
	m := t.subs(sub.f)
	if set := m[sub.f.key()]; set != nil {
		delete(set, sub)
		if len(set) == 0 {
			delete(m, sub.f.key())
		}
	}
}

// leave unregisters a subscriber that stops reading.
func (t *eventTail) leave(sub *tailSub) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.removeLocked(sub)
}

// joined is what join found for a subscriber.
type joined struct {
	// snap is events of the filter from the ring, in order; through is
	// the sequence they account for when the subscriber is not yet
	// registered (every event of the filter up to it is in snap).
	snap    []*tailEvent
	through uint64
	// sub is set when the subscriber is registered on the live tail:
	// its queue gets every event after those of snap.
	sub *tailSub
	// upto (> from) says to read (from, upto] from the stream first.
	upto uint64
	// wait is closed once the tail caught up with the stream at its start.
	wait <-chan struct{}
}

// join is the handover. When the ring holds every event after from, it
// returns the ring's matching events after from and registers a
// subscriber whose queue gets every later one; when more than a history
// batch of them are left, it returns a batch without registering (a
// subscriber holds no more than a batch of the ring at once). Otherwise
// it says which events to read from the stream first.
func (t *eventTail) join(f eventFilter, from uint64) joined {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.isReady {
		return joined{wait: t.ready}
	}
	if from < t.covered {
		return joined{upto: t.covered}
	}
	idx := t.bySubject
	if f.job == "" {
		idx = t.byTenant
	}
	var snap []*tailEvent
	if l := idx[f.key()]; l != nil {
		snap = l.after(from, t.cfg.HistoryBatch+1)
	}
	if len(snap) > t.cfg.HistoryBatch {
		snap = snap[:t.cfg.HistoryBatch]
		return joined{snap: snap, through: snap[len(snap)-1].seq}
	}
	sub := &tailSub{f: f, queue: make(chan *tailEvent, t.cfg.QueueEvents)}
	m := t.subs(f)
	set := m[f.key()]
	if set == nil {
		set = map[*tailSub]struct{}{}
		m[f.key()] = set
	}
	set[sub] = struct{}{}
	return joined{snap: snap, sub: sub}
}

// tailStats is what tests and benchmarks read of the tail.
type tailStats struct {
	ringEvents    int
	ringBytes     int64
	covered, last uint64
	subscribers   int
	cut           int
}

func (t *eventTail) stats() tailStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, m := range []map[string]map[*tailSub]struct{}{t.tenantSubs, t.jobSubs} {
		for _, set := range m {
			n += len(set)
		}
	}
	return tailStats{ringEvents: t.ring.len(), ringBytes: t.bytes, covered: t.covered, last: t.last, subscribers: n, cut: t.cut}
}

// historyBatchWait bounds one batch read of history from the stream.
const historyBatchWait = 10 * time.Second

// readBatch reads up to HistoryBatch events of f in (from, upto] from the
// stream on a consumer of its own, deleted before it returns. through is
// the last sequence the batch accounts for: upto when no event of f is
// left in (from, upto].
//
// The consumer counts the events its own server holds, which on a cluster
// may be a member that lags: the tail read up to upto, but that member may
// not hold the last of them. A count of 0 short of upto is taken as the
// end of f's events only when the stream's leader holds none either
// (bus.LeaderNext); else the read goes on, and a batch that cannot get an
// event the leader holds ends in an error, never in a skip: the
// subscriber goes to the ring at upto after this read, so an event left
// unread here would never reach it.
func (t *eventTail) readBatch(ctx context.Context, f eventFilter, from, upto uint64) (evs []*tailEvent, through uint64, err error) {
	ctx, cancel := context.WithTimeout(ctx, historyBatchWait)
	defer cancel()
	var name [8]byte
	_, _ = rand.Read(name[:])
	cons, err := t.js.CreateConsumer(ctx, contracts.StreamJobEvents, jetstream.ConsumerConfig{
		Name:              "gw-sse-" + hex.EncodeToString(name[:]),
		FilterSubject:     f.subject,
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       from + 1,
		AckPolicy:         jetstream.AckNonePolicy,
		InactiveThreshold: streamInactiveThreshold,
		MemoryStorage:     true,
		Replicas:          1,
	})
	if err != nil {
		return nil, 0, fmt.Errorf("reading job event history: %w", err)
	}
	defer func() {
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer dcancel()
		if derr := t.js.DeleteConsumer(dctx, contracts.StreamJobEvents, cons.CachedInfo().Name); derr != nil &&
			!errors.Is(derr, jetstream.ErrConsumerNotFound) {
			t.log.Debug("history consumer not deleted; it expires by itself", "consumer", cons.CachedInfo().Name, "err", derr)
		}
	}()
	pending := cons.CachedInfo().NumPending
	// behind is an event of f the stream holds that the consumer's
	// server did not count.
	var behind uint64
	if pending == 0 {
		next, err := t.nextEvent(ctx, f, from, upto)
		if err != nil {
			return nil, 0, err
		}
		if next == 0 {
			return nil, upto, nil
		}
		// The consumer's server lags: wait for it to deliver the event.
		behind, pending = next, 1
	}
	// Every pending message is there already (JOB_EVENTS keeps its
	// messages), so the fetch returns as soon as it has them all.
	batch, err := cons.Fetch(int(min(pending, uint64(t.cfg.HistoryBatch))), jetstream.FetchMaxWait(historyBatchWait/2))
	if err != nil {
		return nil, 0, fmt.Errorf("reading job event history: %w", err)
	}
	through = from
	// left is what the consumer counts past through.
	done, left := false, pending
	for m := range batch.Messages() {
		md, err := m.Metadata()
		if err != nil || done {
			continue
		}
		seq := md.Sequence.Stream
		if seq > upto {
			done = true
			continue
		}
		through, left = seq, md.NumPending
		if e, perr := parseTailEvent(m.Subject(), seq, m.Data()); perr == nil {
			evs = append(evs, e)
		}
		done = seq == upto
	}
	if done {
		return evs, upto, nil
	}
	if through == from {
		if err := batch.Error(); err != nil {
			return nil, 0, fmt.Errorf("reading job event history: %w", err)
		}
		if behind > 0 {
			return nil, 0, fmt.Errorf("reading job event history: the stream holds event %d of %s, but the consumer's server delivered nothing after %d",
				behind, f.subject, from)
		}
		return nil, 0, fmt.Errorf("reading job event history: no message of %d pending after %d", pending, from)
	}
	if left == 0 {
		next, err := t.nextEvent(ctx, f, through, upto)
		if err != nil {
			return nil, 0, err
		}
		if next == 0 {
			return evs, upto, nil
		}
	}
	return evs, through, nil
}

// nextEvent returns the sequence of the first event of f in (after, upto]
// as JOB_EVENTS' leader holds it: 0 when there is none.
func (t *eventTail) nextEvent(ctx context.Context, f eventFilter, after, upto uint64) (uint64, error) {
	next, err := bus.LeaderNext(ctx, t.bus.Conn(), contracts.StreamJobEvents, []string{f.subject}, after+1, time.Time{})
	if err != nil {
		return 0, fmt.Errorf("reading job event history: %w", err)
	}
	if next > upto {
		return 0, nil
	}
	return next, nil
}

// tailReader is one subscriber's view: every event of its filter after
// from, once and in stream order, from the stream, the ring and the live
// tail in turn.
type tailReader struct {
	t *eventTail
	f eventFilter
	// from is the last sequence returned or accounted for: every event
	// of f up to it was returned already.
	from uint64
	// pending is a batch (from the ring or the stream) still to return;
	// through is the sequence it accounts for up to.
	pending []*tailEvent
	through uint64
	// sub is set while registered on the live tail.
	sub *tailSub
}

func (t *eventTail) reader(f eventFilter, from uint64) *tailReader {
	return &tailReader{t: t, f: f, from: from}
}

// next returns the next event, waiting for it until idle fires (nil, nil)
// or ctx ends. An error ends the stream: the history could not be read.
func (r *tailReader) next(ctx context.Context, idle <-chan time.Time) (*tailEvent, error) {
	for {
		for len(r.pending) > 0 {
			e := r.pending[0]
			r.pending[0], r.pending = nil, r.pending[1:]
			if len(r.pending) == 0 {
				r.pending = nil // let the batch's array go
			}
			if e.seq > r.from {
				r.from = e.seq
				return e, nil
			}
		}
		r.from = max(r.from, r.through)
		if r.sub == nil {
			j := r.t.join(r.f, r.from)
			switch {
			case j.wait != nil:
				select {
				case <-j.wait:
					continue
				case <-idle:
					return nil, nil
				case <-ctx.Done():
					return nil, ctx.Err()
				}
			case j.sub != nil:
				r.sub, r.pending = j.sub, j.snap
				continue
			case j.upto == 0:
				r.pending, r.through = j.snap, j.through
				continue
			}
			select {
			case r.t.history <- struct{}{}:
			case <-idle:
				return nil, nil
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			evs, through, err := r.t.readBatch(ctx, r.f, r.from, j.upto)
			<-r.t.history
			if err != nil {
				return nil, err
			}
			r.pending, r.through = evs, through
			continue
		}
		select {
		case e, ok := <-r.sub.queue:
			if !ok {
				r.sub = nil // cut for a full queue: catch up again
				continue
			}
			if e.seq > r.from {
				r.from = e.seq
				return e, nil
			}
		case <-idle:
			return nil, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// buffered says whether next has an event at hand without waiting.
func (r *tailReader) buffered() bool {
	return len(r.pending) > 0 || r.sub != nil && len(r.sub.queue) > 0
}

// close unregisters the reader from the live tail.
func (r *tailReader) close() {
	if r.sub != nil {
		r.t.leave(r.sub)
		r.sub = nil
	}
}
