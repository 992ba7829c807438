// Package natsserver runs an embedded NATS server with JetStream, for
// `make run` and for tests. Production uses a real NATS cluster instead; the
// services only ever see a URL.
package natsserver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Options configure the embedded server.
type Options struct {
	// Host to listen on; default 127.0.0.1. The embedded server is for one
	// machine and never listens on other interfaces by default.
	Host string
	// Port to listen on; -1 (the default when 0) picks a free port.
	Port int
	// StoreDir holds JetStream data. Empty means a new temporary directory,
	// removed by Shutdown.
	StoreDir string
	// SyncAlways makes JetStream fsync every write (production setting for
	// the log of record; slower).
	SyncAlways bool
	// MaxMemory and MaxStore bound JetStream; 0 means the server default.
	MaxMemory int64
	MaxStore  int64
	// Name of the server; default "gpuplane-embedded".
	Name string
	// HTTPPort enables the NATS monitoring endpoint when > 0 (or -1 for a random port).
	HTTPPort int
}

// Server is a running embedded server.
type Server struct {
	*server.Server
	tempDir string
}

// Start starts the server and waits until it accepts connections.
func Start(ctx context.Context, o Options) (*Server, error) {
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.Port == 0 {
		o.Port = -1
	}
	if o.Name == "" {
		o.Name = "gpuplane-embedded"
	}
	s := &Server{}
	if o.StoreDir == "" {
		dir, err := os.MkdirTemp("", "gpuplane-nats-*")
		if err != nil {
			return nil, fmt.Errorf("create jetstream dir: %w", err)
		}
		o.StoreDir, s.tempDir = dir, dir
	}
	opts := &server.Options{
		ServerName:         o.Name,
		Host:               o.Host,
		Port:               o.Port,
		JetStream:          true,
		StoreDir:           o.StoreDir,
		JetStreamMaxMemory: o.MaxMemory,
		JetStreamMaxStore:  o.MaxStore,
		NoSigs:             true,
		NoLog:              true,
		MaxPayload:         1 << 20,
	}
	if o.HTTPPort != 0 {
		opts.HTTPHost = o.Host
		opts.HTTPPort = o.HTTPPort
	}
	if o.SyncAlways {
		opts.SyncAlways = true
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		s.cleanup()
		return nil, fmt.Errorf("new nats server: %w", err)
	}
	s.Server = ns
	go ns.Start()
	deadline := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		deadline = time.Until(d)
	}
	if !ns.ReadyForConnections(deadline) {
		ns.Shutdown()
		s.cleanup()
		return nil, errors.New("embedded nats server did not become ready")
	}
	return s, nil
}

// URL is the client URL of the server.
func (s *Server) URL() string { return s.ClientURL() }

// StoreDir is where JetStream keeps its data.
func (s *Server) StoreDir() string { return s.JetStreamConfig().StoreDir }

// Shutdown stops the server, waits for it, and removes a temporary store.
func (s *Server) Shutdown() {
	if s.Server != nil {
		s.Server.Shutdown()
		s.Server.WaitForShutdown()
	}
	s.cleanup()
}

func (s *Server) cleanup() {
	if s.tempDir != "" {
		_ = os.RemoveAll(s.tempDir)
	}
}
