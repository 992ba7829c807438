// Package service is the bootstrap every gpuplane service shares: the bus
// and tracing settings common to all, their flags and environment
// variables, and the start-up that turns them into a connected bus. A
// service's own business stays in its own module.
package service

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
)

// BusConfig is the part of every service's config that reaches the bus.
type BusConfig struct {
	// NATSURL of the NATS server or cluster.
	NATSURL string
	// Replicas of each stream (1 embedded, 3 in production).
	Replicas int
	// OTLPEndpoint (host:port, OTLP/HTTP) receives traces; empty disables.
	OTLPEndpoint string
	// CAFile, when set, makes the NATS connection TLS 1.3 verified
	// against this CA (PEM).
	CAFile string
	// Creds is the service's NATS creds file (see deploy/identities.yaml
	// and natsauth): the server refuses a connection without one.
	Creds string
}

// DefaultBusConfig reads GPUPLANE_NATS_URL, GPUPLANE_STREAM_REPLICAS and
// GPUPLANE_OTLP_ENDPOINT, with local defaults.
func DefaultBusConfig() BusConfig {
	c := BusConfig{NATSURL: envOr("GPUPLANE_NATS_URL", "nats://127.0.0.1:4222"), Replicas: 1,
		OTLPEndpoint: os.Getenv("GPUPLANE_OTLP_ENDPOINT"), Creds: os.Getenv("GPUPLANE_NATS_CREDS"),
		CAFile: os.Getenv("GPUPLANE_NATS_CA")}
	if n, err := strconv.Atoi(os.Getenv("GPUPLANE_STREAM_REPLICAS")); err == nil {
		c.Replicas = n
	}
	return c
}

// RegisterFlags adds -nats, -replicas and -otlp to fs, defaulting to c.
func (c *BusConfig) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.NATSURL, "nats", c.NATSURL, "NATS URL (env GPUPLANE_NATS_URL)")
	fs.IntVar(&c.Replicas, "replicas", c.Replicas, "JetStream stream replicas, 1 or 3 (env GPUPLANE_STREAM_REPLICAS)")
	fs.StringVar(&c.Creds, "creds", c.Creds, "NATS creds file of this service's identity (env GPUPLANE_NATS_CREDS)")
	fs.StringVar(&c.CAFile, "nats-ca", c.CAFile, "CA (PEM) of the NATS servers' certificates: TLS 1.3 to NATS (env GPUPLANE_NATS_CA)")
	fs.StringVar(&c.OTLPEndpoint, "otlp", c.OTLPEndpoint, "OTLP/HTTP endpoint host:port for traces, empty to disable (env GPUPLANE_OTLP_ENDPOINT)")
}

// Validate reports every problem at once.
func (c BusConfig) Validate() error {
	var errs []error
	if c.NATSURL == "" {
		errs = append(errs, errors.New("nats URL is empty"))
	}
	if c.Replicas != 1 && c.Replicas != 3 && c.Replicas != 5 {
		errs = append(errs, fmt.Errorf("replicas is %d; want 1, 3 or 5", c.Replicas))
	}
	return errors.Join(errs...)
}

// Runtime is what Start gives a service.
type Runtime struct {
	Bus     *bus.Bus
	Tracing *telemetry.Tracing
	Log     *slog.Logger
}

// Start sets up tracing for service name and connects the bus (which
// provisions the streams).
func Start(ctx context.Context, name string, c BusConfig, log *slog.Logger) (*Runtime, error) {
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if log == nil {
		log = slog.Default()
	}
	log = log.With("service", name)
	tr, err := telemetry.NewTracing(ctx, telemetry.TraceConfig{Service: name, OTLPEndpoint: c.OTLPEndpoint})
	if err != nil {
		return nil, fmt.Errorf("%s: tracing: %w", name, err)
	}
	var opts []nats.Option
	if c.CAFile != "" {
		opts = append(opts, nats.Secure(&tls.Config{MinVersion: tls.VersionTLS13}), nats.RootCAs(c.CAFile))
	}
	b, err := bus.Connect(ctx, bus.Config{
		URL: c.NATSURL, Name: name, Logger: log, TracerProvider: tr.Provider, CredsFile: c.Creds, Options: opts,
		Streams: contracts.StreamOptions{Replicas: c.Replicas},
	})
	if err != nil {
		_ = tr.Shutdown(ctx)
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return &Runtime{Bus: b, Tracing: tr, Log: log}, nil
}

// Close drains the bus and flushes traces, within 10 seconds.
func (r *Runtime) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Bus.Close(ctx); err != nil {
		r.Log.Warn("bus close", "err", err)
	}
	if err := r.Tracing.Shutdown(ctx); err != nil {
		r.Log.Warn("tracing shutdown", "err", err)
	}
}

// Main is the body of a thin main: it builds the logger from
// GPUPLANE_LOG_LEVEL and GPUPLANE_LOG_FORMAT, starts the profiling
// listener when GPUPLANE_PPROF_ADDR asks for one, runs run until SIGINT or
// SIGTERM, and exits non-zero on error.
func Main(name string, run func(ctx context.Context, log *slog.Logger) error) {
	log, err := telemetry.NewLogger(os.Stderr, telemetry.LogConfig{
		Level: os.Getenv("GPUPLANE_LOG_LEVEL"), Format: os.Getenv("GPUPLANE_LOG_FORMAT")})
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// GPUPLANE_PPROF_ADDR: opt-in profiling of a running service (pprof.go).
	if err := startPprofFromEnv(ctx, log.With("service", name)); err != nil {
		log.Error("exit", "service", name, "err", err)
		os.Exit(2)
	}
	if err := run(ctx, log); err != nil && !errors.Is(err, context.Canceled) {
		log.Error("exit", "service", name, "err", err)
		stop()
		os.Exit(1)
	}
}

func envOr(k, d string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return d
}
