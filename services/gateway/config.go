package gateway

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/service"
)

// Config configures the gateway. DefaultConfig fills every field; Validate
// reports every problem at once.
type Config struct {
	// Bus is the NATS connection shared by every service.
	Bus service.BusConfig
	// Addr is the HTTP listen address; default 127.0.0.1:8080. Tests use
	// 127.0.0.1:0 and learn the port from OnListen.
	Addr string
	// OnListen, if set, is called with the bound address once the listener
	// is open and before requests are served. Not a flag.
	OnListen func(addr string)
	// MaxBodyBytes bounds a request body; a larger one is answered 413
	// too_large. Default and maximum: contracts.MaxMessageBytes.
	MaxBodyBytes int64
	// Heartbeat is the interval of the comment lines an event stream sends
	// while idle, so proxies keep it open; default 15 s.
	Heartbeat time.Duration
	// ShutdownTimeout bounds the graceful HTTP shutdown; default 10 s.
	ShutdownTimeout time.Duration
}

// DefaultConfig returns the defaults, the bus part read from the
// environment (see service.DefaultBusConfig).
func DefaultConfig() Config {
	return Config{
		Bus:             service.DefaultBusConfig(),
		Addr:            "127.0.0.1:8080",
		MaxBodyBytes:    contracts.MaxMessageBytes,
		Heartbeat:       15 * time.Second,
		ShutdownTimeout: 10 * time.Second,
	}
}

// RegisterFlags adds the gateway's flags (and the bus flags) to fs,
// defaulting to the values in c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.Bus.RegisterFlags(fs)
	fs.StringVar(&c.Addr, "addr", c.Addr, "HTTP listen address")
	fs.Int64Var(&c.MaxBodyBytes, "max-body-bytes", c.MaxBodyBytes, "largest accepted request body in bytes")
	fs.DurationVar(&c.Heartbeat, "sse-heartbeat", c.Heartbeat, "interval of keep-alive comments on idle event streams")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "how long a graceful shutdown waits for requests in flight")
}

// Validate reports every problem at once.
func (c Config) Validate() error {
	errs := []error{c.Bus.Validate()}
	if _, _, err := net.SplitHostPort(c.Addr); err != nil {
		errs = append(errs, fmt.Errorf("addr %q: want host:port: %w", c.Addr, err))
	}
	if c.MaxBodyBytes < 1 || c.MaxBodyBytes > contracts.MaxMessageBytes {
		errs = append(errs, fmt.Errorf("max body bytes is %d; want 1 to %d", c.MaxBodyBytes, contracts.MaxMessageBytes))
	}
	if c.Heartbeat <= 0 {
		errs = append(errs, fmt.Errorf("sse heartbeat is %s; want > 0", c.Heartbeat))
	}
	if c.ShutdownTimeout <= 0 {
		errs = append(errs, fmt.Errorf("shutdown timeout is %s; want > 0", c.ShutdownTimeout))
	}
	return errors.Join(errs...)
}
