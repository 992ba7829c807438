// Package telemetry sets up what every service reports about itself: a
// structured logger (log/slog), OpenTelemetry tracing (exported over OTLP
// when an endpoint is configured) and a Prometheus registry.
package telemetry

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// LogConfig configures a logger.
type LogConfig struct {
	// Level is debug, info, warn or error; default info.
	Level string
	// Format is text or json; default text.
	Format string
}

// NewLogger returns a logger writing to w. Services get it injected; there
// is no global logger.
func NewLogger(w io.Writer, c LogConfig) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(strings.ToUpper(orDefault(c.Level, "info")))); err != nil {
		return nil, fmt.Errorf("log level %q: %w", c.Level, err)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch orDefault(c.Format, "text") {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, fmt.Errorf("log format %q: want text or json", c.Format)
	}
}

// TraceConfig configures tracing for one service.
type TraceConfig struct {
	// Service is the service.name resource attribute.
	Service string
	// OTLPEndpoint is host:port of an OTLP/HTTP receiver (Jaeger: 4318).
	// Empty disables export; spans are then not recorded at all.
	OTLPEndpoint string
	// SampleRatio of new traces to keep; default 1.
	SampleRatio float64
}

// Tracing is a service's tracer provider and its shutdown.
type Tracing struct {
	Provider trace.TracerProvider
	shutdown func(context.Context) error
}

// Shutdown flushes and stops the exporter.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t.shutdown == nil {
		return nil
	}
	return t.shutdown(ctx)
}

// NewTracing builds a tracer provider for one service. It is not installed
// globally: several services share a process in `make run`, each with its
// own service name.
func NewTracing(ctx context.Context, c TraceConfig) (*Tracing, error) {
	if c.OTLPEndpoint == "" {
		return &Tracing{Provider: noop.NewTracerProvider()}, nil
	}
	exp, err := otlptracehttp.New(ctx,
		otlptracehttp.WithEndpoint(c.OTLPEndpoint),
		otlptracehttp.WithInsecure(),
		otlptracehttp.WithTimeout(5*time.Second))
	if err != nil {
		return nil, fmt.Errorf("otlp exporter: %w", err)
	}
	ratio := c.SampleRatio
	if ratio <= 0 {
		ratio = 1
	}
	res := resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName(c.Service))
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(500*time.Millisecond)),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(Sampler(ratio)),
	)
	return &Tracing{Provider: tp, shutdown: tp.Shutdown}, nil
}

// NewRegistry returns a Prometheus registry with the Go runtime and process
// collectors registered.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// MetricsHandler serves a registry in the Prometheus text format.
func MetricsHandler(g prometheus.Gatherer) http.Handler {
	return promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}
