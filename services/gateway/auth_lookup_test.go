package gateway

import (
	"context"
	"log/slog"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestTokenUsableAtOnce: a token another replica (or this one) has just
// stored authenticates before this gateway's watch of the identity
// buckets has delivered it, with its bindings: a client uses a token the
// moment login hands it over. Here no watch runs at all, so only the
// direct lookup can find it; a revoked token stays refused.
func TestTokenUsableAtOnce(t *testing.T) {
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "gateway", CredsFile: natstest.Service(t, srv, contracts.BusGateway),
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())
	ids := newIdentities(slog.New(slog.DiscardHandler))
	for bucket, p := range map[string]*atomic.Pointer[jetstream.KeyValue]{
		contracts.BucketAPITokens: &ids.tokensKV, contracts.BucketRoleBindings: &ids.bindingsKV} {
		kv, err := b.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		p.Store(&kv)
	}
	secret, err := IssueToken(ctx, b, Grant{ID: "tfresh", Name: "fresh", Bindings: []contracts.Binding{{Role: contracts.RoleMember, Tenant: "acme"}}})
	if err != nil {
		t.Fatal(err)
	}
	a := &authenticator{ids: ids, now: time.Now}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "/v1/whoami", nil)
	req.Header.Set("Authorization", "Bearer "+secret)
	p, aerr := a.authenticate(req)
	if aerr != nil {
		t.Fatalf("a just-issued token was refused: %v", aerr)
	}
	if !p.has(contracts.RoleMember, "acme") {
		t.Fatalf("a just-issued token came without its bindings: %+v", p.Roles)
	}
	kv := *ids.tokensKV.Load()
	if err := kv.Delete(ctx, "tfresh"); err != nil {
		t.Fatal(err)
	}
	ids2 := newIdentities(slog.New(slog.DiscardHandler))
	ids2.tokensKV.Store(ids.tokensKV.Load())
	ids2.bindingsKV.Store(ids.bindingsKV.Load())
	if _, aerr := (&authenticator{ids: ids2, now: time.Now}).authenticate(req); aerr == nil || aerr.reason != contracts.ReasonInvalidToken {
		t.Fatalf("a revoked token: %v, want invalid_token", aerr)
	}
}

// TestRefreshAppliesOwnWrites: after the gateway writes an identity key,
// refresh puts what KV holds into the cache (and a delete takes it out)
// without waiting for the watch, which does not run here.
func TestRefreshAppliesOwnWrites(t *testing.T) {
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "gateway", CredsFile: natstest.Service(t, srv, contracts.BusGateway),
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(context.Background())
	ids := newIdentities(slog.New(slog.DiscardHandler))
	kv, err := b.KeyValue(ctx, contracts.BucketRoleBindings)
	if err != nil {
		t.Fatal(err)
	}
	ids.bindingsKV.Store(&kv)
	key := contracts.RoleBindingsKey("token:bob")
	if err := putJSON(ctx, kv, key, contracts.RoleBindings{Subject: "token:bob",
		Bindings: []contracts.Binding{{Role: contracts.RoleMember, Tenant: "acme"}}}); err != nil {
		t.Fatal(err)
	}
	ids.refresh(ctx, contracts.BucketRoleBindings, key)
	if got := ids.roles("token:bob"); len(got) != 1 || got[0].Tenant != "acme" {
		t.Fatalf("after a write and refresh: %+v", got)
	}
	if err := kv.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	ids.refresh(ctx, contracts.BucketRoleBindings, key)
	if got := ids.roles("token:bob"); len(got) != 0 {
		t.Fatalf("after a delete and refresh: %+v", got)
	}
}
