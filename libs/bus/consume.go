package bus

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	segjson "github.com/segmentio/encoding/json"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/telemetry"
)

// Msg is one message delivered from a stream.
type Msg struct {
	Subject      string
	Data         []byte
	Header       nats.Header
	Stream       string
	StreamSeq    uint64
	NumDelivered uint64
	NumPending   uint64
	Timestamp    time.Time
	// Prepared is what ConsumerSpec.Prepare returned for the message
	// (ConsumePipelined), or nil.
	Prepared any
	raw      jetstream.Msg
}

// Decode unmarshals the body into v. It decodes with
// github.com/segmentio/encoding/json, which reads what encoding/json
// writes and fills v as encoding/json would (field names matched without
// regard to case, unknown fields ignored, the types' own UnmarshalJSON and
// UnmarshalText used), at about a third of its CPU and half its
// allocations: decoding was the largest single cost of every follower in
// a burst (issue 17). decode_compat_test.go holds it to encoding/json on
// every message type of the contracts.
func (m *Msg) Decode(v any) error {
	if err := segjson.Unmarshal(m.Data, v); err != nil {
		return fmt.Errorf("decode %s seq %d: %w", m.Subject, m.StreamSeq, err)
	}
	return nil
}

// Log returns base with the message's subject and stream sequence, then
// args, as attributes: the logger of one message's handling. slog's With
// formats its attributes at once, so a handler that folds many messages and
// logs almost none (a rebuild reads a million) calls it only when it logs.
func (m *Msg) Log(base *slog.Logger, args ...any) *slog.Logger {
	return base.With(append([]any{"subject", m.Subject, "stream_seq", m.StreamSeq}, args...)...)
}

// ID is the message's Nats-Msg-Id (equal to its ce-id), "" when absent.
func (m *Msg) ID() string { return m.Header.Get(contracts.HeaderMsgID) }

// InProgress tells JetStream the handler is still working, resetting AckWait.
func (m *Msg) InProgress() error {
	if m.raw == nil {
		return nil
	}
	return m.raw.InProgress()
}

// Handler handles one message. Its error decides the message's fate:
//   - nil: the message is acknowledged (see settle).
//   - an error wrapped with Permanent: the message can never succeed; it is
//     copied to the dead-letter subject and terminated. A handler that owes
//     someone an answer (a rejected event) publishes it before returning.
//   - any other error: transient; the message is Nak'ed with backoff and
//     redelivered, up to MaxDeliver times, then dead-lettered. An error
//     wrapped with RetryAfter is redelivered after its own delay.
type Handler func(ctx context.Context, m *Msg) error

// PermanentError marks an error that retrying cannot fix.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err as permanent (see Handler).
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// RetryAfterError is a transient error that asks for redelivery after
// Delay instead of the consumer's backoff: for a dependency known to be
// down for a while (a circuit breaker that is open). It counts towards
// MaxDeliver like any transient error.
type RetryAfterError struct {
	Err   error
	Delay time.Duration
}

func (e *RetryAfterError) Error() string { return fmt.Sprintf("retry after %s: %v", e.Delay, e.Err) }
func (e *RetryAfterError) Unwrap() error { return e.Err }

// RetryAfter marks err as transient, to be redelivered after d (see
// RetryAfterError). A nil err stays nil.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &RetryAfterError{Err: err, Delay: d}
}

// ConsumerSpec describes a durable pull consumer.
type ConsumerSpec struct {
	Stream  string
	Durable string
	// FilterSubjects narrow the stream; empty means all of it.
	FilterSubjects []string
	// DeliverPolicy for a newly created consumer; default all.
	DeliverPolicy jetstream.DeliverPolicy
	// AckWait before an unacknowledged message is redelivered; default
	// 5 s. It bounds how long a message held by a consumer that died waits
	// for another; a live consumer never loses a message to it, because the
	// bus sends InProgress every AckWait/3 for every message it has taken
	// and not settled, handled or waiting for a worker (for at most
	// MaxHandlerTime).
	AckWait time.Duration
	// MaxHandlerTime is how long a handler is kept alive with InProgress;
	// after it the message may be redelivered (a hung handler must not hold
	// it forever). Default 5 minutes.
	MaxHandlerTime time.Duration
	// MaxDeliver attempts before a message is dead-lettered; default 10.
	MaxDeliver int
	// Backoff are the Nak delays by attempt (the last repeats); default
	// 100 ms, 500 ms, 2 s, 5 s.
	Backoff []time.Duration
	// MaxAckPending bounds unacknowledged messages in flight; default 1000.
	MaxAckPending int
	// Batch is how many messages a pull asks for; default 64. Messages
	// prefetched into the client are not yet kept alive (the bus sees
	// them only when it takes them), so Batch × the handler's time should
	// stay well under AckWait.
	Batch int
	// InactiveThreshold removes an abandoned consumer; 0 keeps it.
	InactiveThreshold time.Duration
	// Workers handle messages in parallel when > 1 (default 1: one at a
	// time in stream order). Messages with the same Key go to the same
	// worker, so they are still handled in stream order; handlers must then
	// be safe for concurrent use.
	Workers int
	// Key groups messages that must be handled in order (default: the
	// subject). Only used with Workers > 1, and by ConsumePipelined.
	Key func(*Msg) string
	// Prepare, for ConsumePipelined, is run on each message before it is
	// started, on several goroutines at once (the messages are still
	// started one at a time, in stream order): work that needs nothing
	// but the message, such as decoding it, is taken off the one
	// goroutine that starts them. What it returns is the message's
	// Prepared. It must not panic (one that does fails its message for
	// good).
	Prepare func(*Msg) any
}

func (s *ConsumerSpec) defaults() {
	if s.MaxHandlerTime <= 0 {
		s.MaxHandlerTime = 5 * time.Minute
	}
	if s.AckWait <= 0 {
		s.AckWait = 5 * time.Second
	}
	if s.MaxDeliver <= 0 {
		s.MaxDeliver = 10
	}
	if len(s.Backoff) == 0 {
		s.Backoff = []time.Duration{100 * time.Millisecond, 500 * time.Millisecond, 2 * time.Second, 5 * time.Second}
	}
	if s.MaxAckPending <= 0 {
		s.MaxAckPending = 1000
	}
	if s.Batch <= 0 {
		s.Batch = 64
	}
}

// Consume runs a durable pull consumer, calling h for each message one at a
// time in stream order, until ctx ends (then it returns nil). The consumer
// is created or updated idempotently, so several replicas of a service
// share one durable and JetStream spreads messages between them.
func (b *Bus) Consume(ctx context.Context, spec ConsumerSpec, h Handler) error {
	return b.consume(ctx, spec, func(cons jetstream.Consumer, spec ConsumerSpec) error {
		return b.consumeLoop(ctx, cons, spec, h)
	})
}

// consume creates the durable consumer of spec and runs loop on it until
// ctx ends, creating it again when loop breaks.
func (b *Bus) consume(ctx context.Context, spec ConsumerSpec, loop func(jetstream.Consumer, ConsumerSpec) error) error {
	spec.defaults()
	cfg := jetstream.ConsumerConfig{
		Durable:           spec.Durable,
		Description:       "gpuplane " + b.name,
		FilterSubjects:    spec.FilterSubjects,
		DeliverPolicy:     spec.DeliverPolicy,
		AckPolicy:         jetstream.AckExplicitPolicy,
		AckWait:           spec.AckWait,
		MaxDeliver:        spec.MaxDeliver,
		MaxAckPending:     spec.MaxAckPending,
		InactiveThreshold: spec.InactiveThreshold,
	}
	if len(cfg.FilterSubjects) == 1 {
		// One filter goes in FilterSubject, which nats.go puts in the
		// create request's subject: a scoped identity (a node agent) is
		// allowed to create its consumer only with its own subject there
		// (contracts.Access). The server treats the two forms alike.
		cfg.FilterSubject, cfg.FilterSubjects = cfg.FilterSubjects[0], nil
	}
	log := b.log.With("stream", spec.Stream, "consumer", spec.Durable)
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		var cons jetstream.Consumer
		// One bound per try (retryEach): a create lost on a busy or
		// electing cluster is sent again after 2 s, not nats.go's 5.
		err := retryEach(ctx, func(ctx context.Context) error {
			var err error
			cons, err = b.js.CreateOrUpdateConsumer(ctx, spec.Stream, cfg)
			return err
		})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("bus: consumer %s/%s: %w", spec.Stream, spec.Durable, err)
		}
		err = loop(cons, spec)
		if ctx.Err() != nil {
			return nil
		}
		// The iterator broke (consumer deleted, connection closed for
		// good): start again after a pause.
		log.Warn("consumer interrupted, restarting", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(delay*2, 5*time.Second)
	}
	return nil
}

func (b *Bus) consumeLoop(ctx context.Context, cons jetstream.Consumer, spec ConsumerSpec, h Handler) error {
	p, err := b.pull(ctx, cons, spec)
	if err != nil {
		return err
	}
	defer p.stop()
	settle := func(raw jetstream.Msg) { b.handle(ctx, spec, p, raw, h) }
	dispatch := settle
	if spec.Workers > 1 {
		var wait func()
		dispatch, wait = b.workers(spec, settle)
		defer wait()
	}
	for {
		raw, err := p.next(ctx)
		if err != nil {
			return err
		}
		dispatch(raw)
	}
}

// puller is a consumer's message iterator together with the messages it
// has taken: every one is held until settled and kept alive meanwhile,
// whether it is being handled or waits for a worker or a batch, so only a
// consumer that died lets AckWait pass.
type puller struct {
	it     jetstream.MessagesContext
	hold   *held
	stopKA context.CancelFunc
	log    *slog.Logger
	// drained is what is to be handed back at stop: what drain took from
	// the iterator, and what was taken and not handled (handBack).
	mu        sync.Mutex
	drained   []jetstream.Msg
	drainDone bool
}

// pullExpiry bounds how long a pull request may sit on a consumer leader
// that is no longer there (see pull).
const pullExpiry = 5 * time.Second

// pull starts pulling from cons and keeping held messages alive; stop ends
// both.
func (b *Bus) pull(ctx context.Context, cons jetstream.Consumer, spec ConsumerSpec) (*puller, error) {
	// A pull request lives on the consumer's leader. When that leader
	// changes (a NATS server dies, or a healed partition makes it step
	// down) the request is gone without a word, and nats.go only notices
	// after two missed idle heartbeats: with the default 30 s expiry
	// (15 s heartbeat) the consumer stood still for up to 30 s with work
	// pending and no pull waiting (seen in the chaos suite). A 5 s expiry
	// (2.5 s heartbeat) bounds that to about 5 s for one small request
	// per consumer every 5 s.
	it, err := cons.Messages(jetstream.PullMaxMessages(spec.Batch), jetstream.PullExpiry(pullExpiry))
	if err != nil {
		return nil, err
	}
	hold := &held{msgs: map[jetstream.Msg]time.Time{}}
	// Kept alive until stop, not until ctx ends: at a stop the held
	// messages wait while what was started settles, and past AckWait the
	// server would give them to another replica, which the stop's late
	// Nak would then hand them to again (from a review: every message
	// held at a stop handled twice when a settle outlasted AckWait).
	kaCtx, stopKA := context.WithCancel(context.WithoutCancel(ctx))
	go hold.keepAlive(kaCtx, spec.AckWait/3, spec.MaxHandlerTime)
	return &puller{it: it, hold: hold, stopKA: stopKA,
		log: b.log.With("stream", spec.Stream, "consumer", spec.Durable)}, nil
}

// stop stops pulling (drain) and hands back, with a Nak, what the
// iterator had received and nobody took, so that the next consumer gets
// it at once. The caller has settled everything it took.
func (p *puller) stop() {
	p.drain()
	p.it.Stop()
	// In stream order: the server redelivers Nak'ed messages mostly in
	// the order they came back (from a review).
	p.mu.Lock()
	back := p.drained
	p.drained = nil
	p.mu.Unlock()
	slices.SortFunc(back, func(a, b jetstream.Msg) int { return cmp.Compare(streamSeq(a), streamSeq(b)) })
	for _, raw := range back {
		_ = raw.Nak()
		p.hold.done(raw)
	}
	p.stopKA()
}

// handBack notes a held message taken and not handled, for stop to hand
// back with those the iterator held (held and kept alive meanwhile).
func (p *puller) handBack(raw jetstream.Msg) {
	p.mu.Lock()
	p.drained = append(p.drained, raw)
	p.mu.Unlock()
}

func streamSeq(m jetstream.Msg) uint64 {
	md, err := m.Metadata()
	if err != nil {
		return 0
	}
	return md.Sequence.Stream
}

// drainWait bounds the wait for the iterator's last messages at a stop: a
// drain needs one round trip to the server, which a lost connection never
// answers (what is left then waits out AckWait, as any message does whose
// consumer died).
const drainWait = 2 * time.Second

// drain stops pulling and takes what the iterator already received. Stop
// alone would drop those messages on the floor, and the server would give
// them to another consumer only after AckWait (30 s for the scheduler): a
// stopping consumer (a replica losing its lease, a restart) held up to a
// batch of requests for that long (seen in CI: three cancels taken by the
// iterator, not by the intake, at its stop). They are kept alive and held
// until stop hands them back. Idempotent; no Next may run concurrently.
func (p *puller) drain() {
	if p.drainDone {
		return
	}
	p.drainDone = true
	p.it.Drain()
	deadline := time.Now().Add(drainWait)
	for {
		wait := time.Until(deadline)
		if wait <= 0 {
			return // the server never answered
		}
		raw, err := p.it.Next(jetstream.NextMaxWait(wait))
		switch {
		case errors.Is(err, jetstream.ErrMsgIteratorClosed):
			return // all taken
		case err != nil:
			continue // a heartbeat missed, a reconnect: the buffer may hold more
		}
		p.hold.add(raw)
		p.handBack(raw)
	}
}

// next waits for the next message and holds it. It fails only when ctx
// ends or the iterator closed for good (the consumer must be created
// again); hiccups are waited through.
func (p *puller) next(ctx context.Context) (jetstream.Msg, error) {
	for {
		raw, err := p.it.Next(jetstream.NextContext(ctx))
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
				return nil, err
			}
			// Heartbeat misses and similar hiccups: the iterator recovers.
			p.log.Debug("pull consumer hiccup", "err", err)
			continue
		}
		p.hold.add(raw)
		if ctx.Err() != nil {
			// Next chooses at random between a buffered message and the
			// end of ctx: one taken after the end is handed back at the
			// stop, in its order, not handled (from a review).
			p.handBack(raw)
			return nil, ctx.Err()
		}
		return raw, nil
	}
}

// held is the set of messages a consumer has taken and not yet settled.
type held struct {
	mu   sync.Mutex
	msgs map[jetstream.Msg]time.Time // when taken
}

func (h *held) add(m jetstream.Msg) {
	h.mu.Lock()
	h.msgs[m] = time.Now()
	h.mu.Unlock()
}

func (h *held) done(m jetstream.Msg) {
	h.mu.Lock()
	delete(h.msgs, m)
	h.mu.Unlock()
}

// keepAlive sends InProgress for every held message each interval, except
// those held longer than max: a hung handler must not keep its message
// from everyone else forever.
func (h *held) keepAlive(ctx context.Context, interval, max time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		h.mu.Lock()
		alive := make([]jetstream.Msg, 0, len(h.msgs))
		for m, since := range h.msgs {
			if time.Since(since) < max {
				alive = append(alive, m)
			}
		}
		h.mu.Unlock()
		for _, m := range alive {
			_ = m.InProgress()
		}
	}
}

// workers starts spec.Workers goroutines, each handling its share of the
// keys in arrival order. dispatch blocks when the chosen worker is busy and
// its buffer full: back-pressure instead of unbounded memory. wait stops
// the workers after their buffered messages (which settle or, once ctx has
// ended, are Nak'ed for redelivery).
func (b *Bus) workers(spec ConsumerSpec, settle func(jetstream.Msg)) (dispatch func(jetstream.Msg), wait func()) {
	key := spec.Key
	if key == nil {
		key = func(m *Msg) string { return m.Subject }
	}
	queues := make([]chan jetstream.Msg, spec.Workers)
	var wg sync.WaitGroup
	for i := range queues {
		queues[i] = make(chan jetstream.Msg, 32)
		wg.Go(func() {
			for raw := range queues[i] {
				settle(raw)
			}
		})
	}
	dispatch = func(raw jetstream.Msg) {
		f := fnv.New32a()
		_, _ = f.Write([]byte(key(newMsg(raw))))
		queues[f.Sum32()%uint32(len(queues))] <- raw
	}
	wait = func() {
		for _, q := range queues {
			close(q)
		}
		wg.Wait()
	}
	return dispatch, wait
}

// handle runs h on one message and settles it.
func (b *Bus) handle(ctx context.Context, spec ConsumerSpec, p *puller, raw jetstream.Msg, h Handler) {
	m := newMsg(raw)
	ctx, span := b.startProcess(ctx, spec, m)
	defer span.End()
	err := b.nakOnce(m)
	if err == nil {
		err = safeCall(ctx, h, m)
	}
	b.attempted(m, span, err != nil)
	b.settle(ctx, spec, p, raw, m, span, err)
}

// startProcess starts the span of one message's handling, a child of its
// publisher's, with the job's attributes in ctx.
func (b *Bus) startProcess(ctx context.Context, spec ConsumerSpec, m *Msg) (context.Context, trace.Span) {
	ctx = b.prop.Extract(ctx, headerCarrier(m.Header))
	if !b.traced {
		// A no-op span (the publisher's context, which the handler's
		// publishes carry on): its name and attributes, and the job's
		// attributes for the spans of those publishes, would all be
		// dropped. ~21 deliveries a job in a burst (issue 17).
		return b.tracer.Start(ctx, "")
	}
	attrs := jobAttrs(m)
	ctx = telemetry.WithAttrs(ctx, attrs...)
	ctx, span := b.tracer.Start(ctx, "process "+m.Subject, trace.WithAttributes(attrs...),
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.destination.name", m.Subject),
			attribute.String("messaging.consumer.group.name", spec.Durable),
			attribute.String("messaging.message.id", m.ID()),
			attribute.Int64("messaging.nats.sequence", int64(m.StreamSeq)),
			attribute.Int64("messaging.nats.delivered", int64(m.NumDelivered)),
		), b.redeliveryLinks(ctx, m))
	return ctx, span
}

// settle acknowledges, redelivers or dead-letters one handled message
// according to the handler's error (see Handler), and p stops holding it;
// one whose handler gave up at the stop (ctx's error) p hands back at its
// stop instead.
//
// The ack is a plain one: it does not wait for the server to confirm it.
// A lost ack is a redelivery, which an idempotent handler shrugs off, and
// waiting would not prevent it (a confirmation that does not come is
// given up on too). Waiting did cost: the confirmation comes from the
// consumer's leader, and one that changed meanwhile (a cluster electing at
// a cold start, a member lost or restarted) never answers, so each
// consumer stood still for nats.go's 5 s API timeout before its next
// message (issue 13, finding 6); on R3 every ack also waited for its
// replication.
func (b *Bus) settle(ctx context.Context, spec ConsumerSpec, p *puller, raw jetstream.Msg, m *Msg, span trace.Span, err error) {
	if err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		// Shutting down mid-handler: handed back at the stop with what
		// else is, in stream order. Nak'ed now, while the iterator still
		// pulls, it came back into the buffer behind later messages (from
		// a review; nats-server may still redeliver the first one handed
		// back last, see TestAStoppedConsumerHandsBackWhatItsHandlerGaveUp).
		p.handBack(raw)
		return
	}
	defer p.hold.done(raw)
	// The message's logger is built only when it logs: slog's With
	// formats its attributes at once, and a handled message (nearly
	// every one) logs nothing; it was 1.3 % of a burst's CPU (issue 17).
	log := func() *slog.Logger {
		return b.log.With("subject", m.Subject, "stream_seq", m.StreamSeq, "consumer", spec.Durable)
	}
	if err == nil {
		if aerr := raw.Ack(); aerr != nil && ctx.Err() == nil {
			// The work is done and idempotent: a redelivery is harmless.
			log().Warn("ack failed; message may be redelivered", "err", aerr)
		}
		return
	}
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
	if IsPermanent(err) || m.NumDelivered >= uint64(spec.MaxDeliver) {
		reason := err.Error()
		if !IsPermanent(err) {
			reason = fmt.Sprintf("gave up after %d deliveries: %v", m.NumDelivered, err)
		}
		log().Warn("dead-lettering message", "err", err, "delivered", m.NumDelivered)
		if derr := b.deadLetter(ctx, spec, m, reason); derr != nil {
			// Could not park it: keep it in the stream rather than lose it.
			log().Error("dead-letter publish failed; will retry", "err", derr)
			_ = raw.NakWithDelay(backoff(spec.Backoff, m.NumDelivered))
			return
		}
		_ = raw.TermWithReason(truncate(reason, 200))
		return
	}
	d := backoff(spec.Backoff, m.NumDelivered)
	if ra, ok := errors.AsType[*RetryAfterError](err); ok {
		d = ra.Delay
	}
	log().Info("handler failed; will retry", "err", err, "delivered", m.NumDelivered, "delay", d)
	_ = raw.NakWithDelay(d)
}

// safeCall runs h and turns a panic into a permanent error, so one poison
// message cannot crash a service.
func safeCall(ctx context.Context, h Handler, m *Msg) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = Permanent(fmt.Errorf("handler panic: %v", r))
		}
	}()
	return h(ctx, m)
}

func (b *Bus) deadLetter(ctx context.Context, spec ConsumerSpec, m *Msg, reason string) error {
	opts := []PublishOption{
		Header(contracts.HeaderDeadLetterReason, truncate(reason, 1024)),
		Header(contracts.HeaderDeadLetterSubject, m.Subject),
		Header(contracts.HeaderDeadLetterStream, m.Stream),
		Header(contracts.HeaderDeadLetterSequence, strconv.FormatUint(m.StreamSeq, 10)),
		CEType("io.gpuplane.deadletter.v1"),
	}
	id := "dlq/" + spec.Stream + "/" + spec.Durable + "/" + strconv.FormatUint(m.StreamSeq, 10)
	_, err := b.PublishRaw(ctx, contracts.SubjectDeadLetter(spec.Stream, spec.Durable), id, m.Data, opts...)
	return err
}

func backoff(steps []time.Duration, delivered uint64) time.Duration {
	i := int(delivered) - 1
	if i < 0 {
		i = 0
	}
	if i >= len(steps) {
		i = len(steps) - 1
	}
	return steps[i]
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

func newMsg(raw jetstream.Msg) *Msg {
	m := &Msg{Subject: raw.Subject(), Data: raw.Data(), Header: raw.Headers(), raw: raw}
	if m.Header == nil {
		m.Header = nats.Header{}
	}
	if md, err := raw.Metadata(); err == nil {
		m.Stream = md.Stream
		m.StreamSeq = md.Sequence.Stream
		m.NumDelivered = md.NumDelivered
		m.NumPending = md.NumPending
		m.Timestamp = md.Timestamp
	}
	return m
}
