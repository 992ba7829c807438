package gateway

import (
	"context"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// benchGateway runs a gateway on srv for a benchmark, as the platform
// admin's client sees it: it issues an admin token through issuer, starts
// Run with the gateway's own credentials (mutate adjusts the config), and
// waits until /healthz answers 200, that is until the read model has
// caught up with what srv holds. base is the client's transport (nil:
// http.DefaultTransport), under the token. It returns the base URL, the client and how long the
// start took (catch-up included); the gateway stops when b ends.
func benchGateway(b *testing.B, ctx context.Context, srv *natsserver.Server, issuer *bus.Bus,
	mutate func(*Config), base http.RoundTripper) (string, *http.Client, time.Duration) {
	b.Helper()
	token, err := IssueToken(ctx, issuer, Grant{ID: "bench-admin", Name: "bench-admin", Bindings: []contracts.Binding{{Role: RolePlatformAdmin}}})
	if err != nil {
		b.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Bus.NATSURL, cfg.Bus.Creds, cfg.Bus.OTLPEndpoint, cfg.Bus.Replicas = srv.URL(), natstest.Service(b, srv, contracts.BusGateway), "", 1
	cfg.Addr = "127.0.0.1:0"
	if mutate != nil {
		mutate(&cfg)
	}
	addrs := make(chan string, 1)
	cfg.OnListen = func(a string) { addrs <- a }
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- Run(runCtx, cfg, slog.New(slog.DiscardHandler)) }()
	b.Cleanup(func() { stop(); <-done })
	var url string
	select {
	case a := <-addrs:
		url = "http://" + a
	case err := <-done:
		b.Fatalf("the gateway did not start: %v", err)
	}
	hc := &http.Client{Transport: bearer{token: token, base: base}}
	for {
		res, err := hc.Get(url + "/healthz")
		if err == nil {
			res.Body.Close()
			if res.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Since(start) > 5*time.Minute {
			b.Fatal("the gateway did not catch up in 5 minutes")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return url, hc, time.Since(start)
}
