// Package gateway is gpuplane's HTTP front door. It validates job requests
// exactly as the scheduler will (contracts.DecodeJobRequest) and publishes
// them, and cancel requests, on the bus; it answers reads from a read model
// folded from JOB_EVENTS and USAGE, and a node model folded from NODES; it
// relays job events as server-sent events and run output from LOGS; it
// publishes checkpoint and (admin) fault commands for node agents; it
// keeps the administrators' KV documents (price book, budgets, tenant
// quotas, pool settings, node cordons and drains) with compare-and-set;
// and it serves a small web console.
//
//	client ──POST/DELETE──▶ gateway ──publish──▶ gp.jobs.submit|cancel.<tenant>  (JOBS)
//	client ──POST─────────▶ gateway ──publish──▶ gp.cmd.node.<node>  (NODE_COMMANDS)
//	client ◀──GET/SSE────── gateway ◀──ordered reads── JOB_EVENTS, USAGE, NODES, LOGS
//	admin  ──GET/PUT/POST─▶ gateway ◀──CAS / watch──▶ KV gp-quotas, gp-pools, gp-node-admin, gp-pricebook, gp-budgets
//
// The gateway never decides a job's fate: a 202 means the request is on the
// bus; what became of it arrives as JobEvents from the scheduler.
package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/service"
)

// Name is the service name: the bus connection name and CloudEvents source.
const Name = "gateway"

// Run validates cfg, connects to the bus, listens on cfg.Addr and serves
// until ctx ends, then shuts the HTTP server down gracefully (event streams
// are ended, requests in flight get cfg.ShutdownTimeout) and drains the
// bus. It returns nil after a shutdown asked by ctx, or the error that
// stopped it.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("%s: invalid config: %w", Name, err)
	}
	if log == nil {
		log = slog.Default()
	}
	rt, err := service.Start(ctx, Name, cfg.Bus, log)
	if err != nil {
		return err
	}
	defer rt.Close()
	log = rt.Log

	ln, err := new(net.ListenConfig).Listen(ctx, "tcp", cfg.Addr)
	if err != nil {
		return fmt.Errorf("%s: listen: %w", Name, err)
	}
	addr := ln.Addr().String()

	ret := cfg.Retention.withDefaults()
	model := newRetainingModel(ret, time.Now, streamFetcher(rt.Bus), func(ctx context.Context, tenant string, want map[string]*contracts.JobStatus) error {
		return tenantFetch(ctx, rt.Bus, tenant, want)
	})
	model.aggregateUsage(cfg.Usage, streamUsage(rt.Bus, cfg.Usage))
	in := &ingester{bus: rt.Bus, model: model, nodes: newNodeModel(), log: log, snaps: newModelSnapshotter(rt.Bus, ret.SnapshotInterval, log),
		loadDone: make(chan struct{})}
	streams, endStreams := context.WithCancel(context.Background())
	defer endStreams()
	s := &server{cfg: cfg, bus: rt.Bus, model: in.model, nodes: in.nodes, ready: in.ready, adminReady: in.adminReady.Load,
		log: log, now: time.Now, streams: streams}
	s.buckets = newKVBuckets(rt.Bus)
	s.fleet = newFleetHub(in.nodes, in.model, time.Now)
	in.nodes.changed = s.fleet.changed
	s.ops = newOpsHub()
	var opsReady atomic.Bool
	s.opsReady = opsReady.Load
	s.queues = newQueuesHub()
	s.tail = newEventTail(rt.Bus, cfg.SSE, log)
	in.tail = s.tail // fed by the fold's read of JOB_EVENTS: no read of its own
	in.observe = func(st contracts.JobStatus, ev contracts.JobEvent, _ uint64) {
		s.fleet.observeJob(st)
		s.ops.observeJob(ev)
		s.queues.changed()
	}
	in.loaded = func(st contracts.JobStatus) {
		s.fleet.observeJob(st)
		s.queues.changed()
	}
	in.loadedTenant = s.fleet.noteTenant
	in.loadedOps = s.ops.observeJob
	s.limits = newTenantLimits(cfg.Limits, nil)
	if cfg.onServer != nil {
		cfg.onServer(s)
	}
	if cfg.AdminTokenFile != "" {
		if err := bootstrapAdmin(ctx, rt.Bus, cfg.AdminTokenFile); err != nil {
			_ = ln.Close()
			return fmt.Errorf("%s: %w", Name, err)
		}
		log.Info("platform admin token bootstrapped", "file", cfg.AdminTokenFile, "token_id", bootstrapTokenID)
	}
	ids := newIdentities(log)
	s.auth = &authenticator{ids: ids, now: time.Now}
	if cfg.OIDCIssuer != "" {
		s.auth.oidc = newOIDCVerifier(cfg.OIDCIssuer, cfg.OIDCClientID, time.Now)
	}
	if cfg.LDAPURL != "" {
		if s.auth.ldap, err = newLDAPAuth(cfg); err != nil {
			_ = ln.Close()
			return fmt.Errorf("%s: %w", Name, err)
		}
	}
	s.audit = newAuditLog(rt.Bus, replicaName(addr), log, time.Now)
	if cfg.TLSCert != "" {
		tlsCfg, err := serverTLS(cfg.TLSCert, cfg.TLSKey)
		if err != nil {
			_ = ln.Close()
			return fmt.Errorf("%s: %w", Name, err)
		}
		ln = tls.NewListener(ln, tlsCfg)
	} else {
		log.Warn("gateway serves plaintext HTTP on a loopback address; give -tls-cert and -tls-key to serve TLS 1.3", "addr", addr)
	}
	srv := &http.Server{
		Handler:           s.handler(),
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		BaseContext:       func(net.Listener) context.Context { return context.WithoutCancel(ctx) },
	}
	srv.RegisterOnShutdown(endStreams)

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return in.followJobEvents(gctx) })
	g.Go(func() error { return in.snaps.run(gctx) })
	g.Go(func() error { return in.followUsage(gctx) })
	g.Go(func() error { return in.followNodes(gctx) })
	g.Go(func() error { return in.followNodeAdmin(gctx) })
	g.Go(func() error { return ids.follow(gctx, rt.Bus) })
	g.Go(func() error { return s.fleet.follow(gctx, rt.Bus, log) })
	g.Go(func() error { return s.queues.follow(gctx, rt.Bus, log) })
	g.Go(func() error { return s.ops.follow(gctx, rt.Bus, log, func() { opsReady.Store(true) }) })
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("%s: serve: %w", Name, err)
		}
		return nil
	})
	g.Go(func() error {
		<-gctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			log.Warn("graceful shutdown incomplete; closing connections", "err", err)
			_ = srv.Close()
		}
		return nil
	})
	log.Info("gateway listening", "addr", addr, "tls", cfg.TLSCert != "", "oidc", cfg.OIDCIssuer != "", "ldap", cfg.LDAPURL != "")
	if cfg.OnListen != nil {
		cfg.OnListen(addr)
	}
	err = g.Wait()
	log.Info("gateway stopped", "err", err)
	return err
}

// serverTLS is TLS 1.3 only: a client that offers 1.2 or lower is refused
// in the handshake. The key pair is read again on each handshake when the
// files change (a renewed certificate needs no restart).
func serverTLS(certFile, keyFile string) (*tls.Config, error) {
	kp := &keyPair{cert: certFile, key: keyFile}
	if _, err := kp.get(nil); err != nil {
		return nil, err
	}
	return &tls.Config{MinVersion: tls.VersionTLS13, GetCertificate: kp.get, NextProtos: []string{"h2", "http/1.1"}}, nil
}
