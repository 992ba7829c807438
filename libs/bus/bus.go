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
	nc     *nats.Conn
	js     jetstream.JetStream
	name   string
	log    *slog.Logger
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	opts   contracts.StreamOptions
	mode   ProvisionMode
	// denied holds the subjects the server refused this identity to
	// publish on: a publish there fails for good instead of retrying as
	// if the server were slow.
	denied sync.Map
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
	b.prop = propagation.TraceContext{}
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
// updates the others to contracts' config. A service may only create:
// editing a stream is the operator's (a service that could edit one could
// turn off DenyPurge). It is idempotent and retries while JetStream is not
// yet available (a cluster still electing its meta leader).
func (b *Bus) EnsureStreams(ctx context.Context) error {
	for _, sc := range contracts.Streams(b.opts) {
		if err := retry(ctx, func() error {
			return b.ensureStream(ctx, sc)
		}); err != nil {
			return fmt.Errorf("bus: provision stream %s: %w", sc.Name, err)
		}
	}
	return nil
}

func (b *Bus) ensureStream(ctx context.Context, sc jetstream.StreamConfig) error {
	if b.mode == ProvisionUpdate {
		_, err := b.js.CreateOrUpdateStream(ctx, sc)
		return err
	}
	_, err := b.js.Stream(ctx, sc.Name)
	if err == nil {
		return nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return err
	}
	_, err = b.js.CreateStream(ctx, sc)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return nil // another service created it first
	}
	return err
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
	delay := 50 * time.Millisecond
	for {
		err := fn()
		if err == nil || !transient(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(delay):
		}
		delay = min(delay*2, 2*time.Second)
	}
}

// transient reports whether a JetStream call failed for a reason that
// waiting can fix: no responders, a timeout, a disconnect, a leaderless
// cluster.
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
		return apiErr.Code == 503
	}
	return false
}
