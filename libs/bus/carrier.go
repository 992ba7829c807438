package bus

import (
	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"
)

// headerCarrier carries the W3C trace context in NATS headers. NATS header
// keys are case-sensitive, unlike HTTP's, so propagation.HeaderCarrier
// (which canonicalizes to "Traceparent") would not interoperate with other
// NATS clients that write and read "traceparent".
type headerCarrier nats.Header

var _ propagation.TextMapCarrier = headerCarrier{}

func (c headerCarrier) Get(key string) string { return nats.Header(c).Get(key) }

func (c headerCarrier) Set(key, value string) { nats.Header(c).Set(key, value) }

func (c headerCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
