// Package bus is gpuplane's one way of talking to NATS JetStream: connect
// with endless reconnect, provision the streams of contracts idempotently,
// publish with CloudEvents headers, a Nats-Msg-Id and the trace context, and
// consume durable pull consumers with explicit ack, Nak with backoff,
// Term plus dead-letter for permanent failures, and replay of a stream from
// its first message for rebuilding state.
package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
)

// Config configures a connection.
type Config struct {
	// URL of the NATS server(s), comma separated.
	URL string
	// Name identifies the connection and is the CloudEvents source
	// ("/gpuplane/<name>").
	Name string
	// Streams are the stream options applied at Connect (replicas, storage).
	Streams contracts.StreamOptions
	// SkipProvision leaves streams alone (a client that only publishes).
	SkipProvision bool
	// Logger; default slog.Default().
	Logger *slog.Logger
	// TracerProvider for publish and consume spans; default no-op.
	TracerProvider trace.TracerProvider
	// ConnectTimeout bounds how long Connect waits for the first
	// connection and provisioning; default 30 s.
	ConnectTimeout time.Duration
	// CredsFile is the identity's NATS creds file (natsauth); the server
	// refuses a connection without one. It also sets the identity's inbox
	// prefix, the only reply subjects its permissions allow.
	CredsFile string
	// Options are extra nats.Options (TLS).
	Options []nats.Option
	// Provision says what Connect's provisioning may do: ProvisionCreate
	// (the default, what a service's permissions allow: create the streams
	// that are missing and leave the others alone) or ProvisionUpdate (the
	// operator: create or update every stream to contracts' config).
	Provision ProvisionMode
}

// ProvisionMode is how far stream provisioning goes.
type ProvisionMode int

const (
	// ProvisionCreate creates missing streams and buckets only.
	ProvisionCreate ProvisionMode = iota
	// ProvisionUpdate also updates existing ones to contracts' config.
	ProvisionUpdate
)

// Bus is a connection to JetStream. It is safe for concurrent use.
type Bus struct {
	nc *nats.Conn
	js jetstream.JetStream
	// streams caches stream handles by name (SubjectMsgs).
	streams sync.Map
	name    string
	log     *slog.Logger
	tracer  trace.Tracer
	// traced is false when the tracer provider is the no-op one (no
	// OTLP endpoint): the span of each publish and delivery is then
	// started with no name or attributes, which such a span drops
	// anyway. It still carries the publisher's trace context, so
	// propagation is unchanged.
	traced bool
	prop   propagation.TextMapPropagator
	opts   contracts.StreamOptions
	mode   ProvisionMode
	// attempts and nakOncePrefix: redelivery links and the EnvNakOnce
	// test hook (carrier.go).
	attempts      attempts
	nakOncePrefix string
	// denied holds the subjects the server refused this identity to
	// publish on: a publish there fails for good instead of retrying as
	// if the server were slow.
	denied sync.Map
	// directReads: the identity is scoped (a node agent, a tenant), which
	// may not ask a stream's leader for a message (its request names the
	// subject in its body, where the server checks nothing). A node agent
	// may make a direct get naming its own subject, and lastSeq asks that
	// way; a tenant may make neither (contracts.Access), as before.
	directReads bool
}

// ErrPermissionDenied: the server refused this identity the subject
// (contracts.Access). Retrying does not help.
var ErrPermissionDenied = errors.New("bus: permission denied")

// deniedPublish reads the subject out of the server's refusal of a
// publish, as nats.go reports it to the error handler.
func deniedPublish(err error) (string, bool) {
	if err == nil || !errors.Is(err, nats.ErrPermissionViolation) {
		return "", false
	}
	_, rest, ok := strings.Cut(err.Error(), "Publish to \"")
	if !ok {
		return "", false
	}
	subject, _, ok := strings.Cut(rest, "\"")
	return subject, ok && subject != ""
}

// refused reports whether the server refused this identity subject.
func (b *Bus) refused(subject string) bool {
	_, ok := b.denied.Load(subject)
	return ok
}

// Connect connects to NATS, waits for the connection, and provisions the
// platform's streams unless SkipProvision is set. The connection
// reconnects forever: a NATS restart is an outage to wait out, not a crash.
func Connect(ctx context.Context, cfg Config) (*Bus, error) {
	if cfg.URL == "" {
		return nil, errors.New("bus: no NATS URL")
	}
	if cfg.Name == "" {
		return nil, errors.New("bus: no connection name")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = noop.NewTracerProvider()
	}
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = 30 * time.Second
	}
	log := cfg.Logger.With("component", "bus")
	connected := make(chan struct{}, 1)
	// b is filled in once connected; the error handler records refused
	// publishes in it from the start.
	b := &Bus{}
	opts := append([]nats.Option{
		nats.Name(cfg.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.RetryOnFailedConnect(true),
		nats.ConnectHandler(func(*nats.Conn) {
			select {
			case connected <- struct{}{}:
			default:
			}
		}),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("nats reconnected", "url", nc.ConnectedUrl()) }),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subj := ""
			if sub != nil {
				subj = sub.Subject
			}
			if denied, ok := deniedPublish(err); ok {
				b.denied.Store(denied, struct{}{})
				subj = denied
			}
			log.Warn("nats async error", "subject", subj, "err", err)
		}),
	}, cfg.Options...)
	if cfg.CredsFile != "" {
		id, err := natsauth.IdentityOf(cfg.CredsFile)
		if err != nil {
			return nil, fmt.Errorf("bus: %w", err)
		}
		opts = append(opts, natsauth.IdentityOptions(cfg.CredsFile, id)...)
		// The operator keeps streams at contracts' config; no one else may.
		// A node agent or a tenant may not even create one (the services
		// do): it skips provisioning rather than be refused.
		switch {
		case id.Role == contracts.BusOperator:
			cfg.Provision = ProvisionUpdate
		case id.Role.Scoped():
			cfg.SkipProvision = true
			b.directReads = true
		}
	}

	nc, err := nats.Connect(cfg.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("bus: connect %s: %w", cfg.URL, err)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	if !nc.IsConnected() {
		select {
		case <-connected:
		case <-ctx.Done():
			nc.Close()
			return nil, fmt.Errorf("bus: connect %s: %w", cfg.URL, ctx.Err())
		}
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("bus: jetstream: %w", err)
	}
	b.nc, b.js, b.name, b.log = nc, js, cfg.Name, log
	b.tracer = cfg.TracerProvider.Tracer("github.com/gpuplane/gpuplane/libs/bus")
	_, untraced := cfg.TracerProvider.(noop.TracerProvider)
	b.traced = !untraced
	b.prop = propagation.TraceContext{}
	b.nakOncePrefix = os.Getenv(EnvNakOnce)
	b.opts, b.mode = cfg.Streams, cfg.Provision
	if !cfg.SkipProvision {
		if err := b.EnsureStreams(ctx); err != nil {
			nc.Close()
			return nil, err
		}
	}
	return b, nil
}

// EnsureStreams makes sure every stream of contracts.Streams exists: it
// creates the missing ones and, with ProvisionUpdate (the operator), also
// updates the others that differ from contracts' config. A service may only create:
// editing a stream is the operator's (a service that could edit one could
// turn off DenyPurge). It is idempotent and retries while JetStream is not
// yet available (a cluster still electing its meta leader).
//
// Each call has its own short bound inside ctx (see retryEach): on a fresh
// cluster with several services provisioning at once, the meta leader
// can leave a create unanswered, and the same call sent again succeeds at
// once (issue 13, finding 1).
func (b *Bus) EnsureStreams(ctx context.Context) error {
	for _, sc := range contracts.Streams(b.opts) {
		if err := retryEach(ctx, func(ctx context.Context) error {
			return b.ensureStream(ctx, sc)
		}); err != nil {
			return fmt.Errorf("bus: provision stream %s: %w", sc.Name, err)
		}
	}
	return nil
}

func (b *Bus) ensureStream(ctx context.Context, sc jetstream.StreamConfig) error {
	s, err := b.js.Stream(ctx, sc.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		s, err = b.js.CreateStream(ctx, sc)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Another service created it first (or an earlier try of
			// ours whose answer was lost): it is there, read it back.
			s, err = b.js.Stream(ctx, sc.Name)
		}
	}
	if err != nil {
		return err
	}
	got := s.CachedInfo().Config
	if b.mode != ProvisionUpdate {
		b.checkStream(sc, got)
		return nil
	}
	// The operator updates only a stream that drifted (drift.go says why
	// not every time).
	if drift := streamDrift(sc, got); len(drift) > 0 {
		b.log.Info("updating stream to its contract", "stream", sc.Name, "fields", strings.Join(drift, ","))
		_, err = b.js.UpdateStream(ctx, sc)
		return err
	}
	return nil
}

// checkStream warns when a stream found in place differs from contracts'
// config where it matters. A service may not change it (the operator's
// provisioning does), so this is a warning to the operator, not a reason
// to refuse to start.
func (b *Bus) checkStream(want, got jetstream.StreamConfig) {
	var drift []string
	if !slices.Equal(want.Subjects, got.Subjects) {
		drift = append(drift, fmt.Sprintf("subjects %v, want %v", got.Subjects, want.Subjects))
	}
	if want.Replicas != got.Replicas {
		drift = append(drift, fmt.Sprintf("replicas %d, want %d", got.Replicas, want.Replicas))
	}
	if want.Storage != got.Storage {
		drift = append(drift, fmt.Sprintf("storage %s, want %s", got.Storage, want.Storage))
	}
	if len(drift) > 0 {
		b.log.Warn("stream differs from its contract; the operator's provisioning updates it",
			"stream", want.Name, "drift", strings.Join(drift, "; "))
	}
}

// JetStream exposes the JetStream handle for what the bus does not wrap
// (KV buckets, stream info).
func (b *Bus) JetStream() jetstream.JetStream { return b.js }

// Conn exposes the NATS connection.
func (b *Bus) Conn() *nats.Conn { return b.nc }

// Name is the connection name (the service name).
func (b *Bus) Name() string { return b.name }

// Close drains the connection: in-flight handlers finish and pending
// publishes are flushed before it closes. It waits at most until ctx ends.
func (b *Bus) Close(ctx context.Context) error {
	if b.nc.IsClosed() {
		return nil
	}
	closed := make(chan struct{})
	b.nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
	if err := b.nc.Drain(); err != nil {
		b.nc.Close()
		return fmt.Errorf("bus: drain: %w", err)
	}
	select {
	case <-closed:
		return nil
	case <-ctx.Done():
		b.nc.Close()
		return ctx.Err()
	}
}

// retry runs fn until it succeeds, returns a non-transient error, or ctx
// ends, backing off from 50 ms to 2 s.
func retry(ctx context.Context, fn func() error) error {
	return retryEach(ctx, func(context.Context) error { return fn() })
}

// Bounds of one JetStream administration call (create a stream, a bucket,
// a consumer): the first try waits firstAttempt for its answer, each
// further one twice as long up to maxAttempt, all inside the caller's ctx.
const (
	firstAttempt = 2 * time.Second
	maxAttempt   = 10 * time.Second
)

// retryEach runs fn until it succeeds, returns a non-transient error, or
// ctx ends. Each call gets its own deadline (firstAttempt, doubling to
// maxAttempt): a request the server never answers (sent to a member that
// died, or dropped by a busy meta leader) is sent again instead of
// holding the caller until ctx ends. Between tries it backs off from
// 50 ms to 2 s with jitter, so services started together do not retry in
// step.
func retryEach(ctx context.Context, fn func(ctx context.Context) error) error {
	delay := 50 * time.Millisecond
	attempt := firstAttempt
	for {
		actx, cancel := context.WithTimeout(ctx, attempt)
		err := fn(actx)
		cancel()
		if err == nil || !transient(err) {
			return err
		}
		if ctx.Err() != nil {
			return errors.Join(err, ctx.Err())
		}
		// Full jitter on the upper half: [delay/2, delay).
		wait := delay/2 + rand.N(delay/2)
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(wait):
		}
		delay = min(delay*2, 2*time.Second)
		attempt = min(attempt*2, maxAttempt)
	}
}

// transient reports whether a JetStream call failed for a reason that
// waiting can fix: no responders, a timeout, a disconnect, a leaderless
// cluster.
// jsErrNoSuitablePeers is JetStream's JSClusterNoPeersErrF.
const jsErrNoSuitablePeers jetstream.ErrorCode = 10005

func transient(err error) bool {
	if errors.Is(err, ErrPermissionDenied) {
		return false
	}
	switch {
	case errors.Is(err, nats.ErrNoResponders), errors.Is(err, jetstream.ErrNoStreamResponse),
		errors.Is(err, nats.ErrTimeout), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrConnectionReconnecting),
		errors.Is(err, nats.ErrDisconnected), errors.Is(err, jetstream.ErrJetStreamNotEnabled):
		return true
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		// 503: JetStream temporarily unavailable (no leader / catching up).
		// 10005: no suitable peers, as the meta leader says while it
		// still counts a member offline (on a fresh cluster, or one
		// whose member just restarted); a misconfigured replica count
		// keeps failing until the caller's deadline.
		return apiErr.Code == 503 || apiErr.ErrorCode == jsErrNoSuitablePeers
	}
	return false
}
