package natsauth_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// client is one identity's connection, with the permission errors the
// server sent it.
type client struct {
	id   contracts.Identity
	nc   *nats.Conn
	js   jetstream.JetStream
	mu   sync.Mutex
	errs []string
	cond chan struct{}
}

func (c *client) onErr(_ *nats.Conn, _ *nats.Subscription, err error) {
	c.mu.Lock()
	c.errs = append(c.errs, err.Error())
	c.mu.Unlock()
	select {
	case c.cond <- struct{}{}:
	default:
	}
}

// violated waits up to d for a permissions violation of a publish
// naming subject.
func (c *client) violated(subject string, d time.Duration) bool {
	return c.violatedAs("publish", subject, d)
}

// violatedAs waits up to d for a permissions violation of kind
// ("publish" or "subscription") naming subject.
func (c *client) violatedAs(kind, subject string, d time.Duration) bool {
	deadline := time.After(d)
	for {
		c.mu.Lock()
		for _, e := range c.errs {
			if strings.Contains(strings.ToLower(e), "permissions violation for "+kind) && strings.Contains(e, `"`+subject+`"`) {
				c.mu.Unlock()
				return true
			}
		}
		c.mu.Unlock()
		select {
		case <-c.cond:
		case <-deadline:
			return false
		case <-time.After(20 * time.Millisecond):
		}
	}
}

type harness struct {
	t       *testing.T
	srv     *natsserver.Server
	op      *bus.Bus
	clients map[string]*client
	refused int
	allowed int
}

func newHarness(t *testing.T, ids []contracts.Identity) *harness {
	t.Helper()
	// This test provokes violations on purpose: each is checked below.
	srv := natstest.StartWith(t, natsserver.Options{OnViolation: func(string) {}})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "operator", CredsFile: natstest.Operator(t, srv),
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = op.Close(context.Background()) })
	for _, kv := range contracts.KeyValues(contracts.StreamOptions{}) {
		if _, err := op.KeyValue(ctx, kv.Bucket); err != nil {
			t.Fatal(err)
		}
	}
	h := &harness{t: t, srv: srv, op: op, clients: map[string]*client{}}
	for _, id := range ids {
		c := &client{id: id, cond: make(chan struct{}, 1)}
		opts, err := natsauth.ClientOptions(natstest.Creds(t, srv, id))
		if err != nil {
			t.Fatal(err)
		}
		opts = append(opts, nats.ErrorHandler(c.onErr), nats.Name(id.Name))
		c.nc, err = nats.Connect(srv.URL(), opts...)
		if err != nil {
			t.Fatalf("%s: connect: %v", id.Name, err)
		}
		t.Cleanup(c.nc.Close)
		if c.js, err = jetstream.New(c.nc); err != nil {
			t.Fatal(err)
		}
		h.clients[id.Name] = c
	}
	return h
}

func (h *harness) count(allowed bool) {
	if allowed {
		h.allowed++
	} else {
		h.refused++
	}
}

// publish checks whether c's publish on subject reaches stream; want says
// whether it should.
func (h *harness) publish(c *client, stream, subject string, want bool) {
	h.t.Helper()
	payload := []byte("forged-" + nuid.Next())
	if err := c.nc.Publish(subject, payload); err != nil {
		h.t.Fatalf("%s: publish %s: %v", c.id.Name, subject, err)
	}
	if err := c.nc.Flush(); err != nil {
		h.t.Fatalf("%s: flush: %v", c.id.Name, err)
	}
	stored := func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		s, err := h.op.JetStream().Stream(ctx, stream)
		if err != nil {
			h.t.Fatal(err)
		}
		m, err := s.GetLastMsgForSubject(ctx, subject)
		return err == nil && string(m.Data) == string(payload)
	}
	if want {
		deadline := time.Now().Add(3 * time.Second)
		for !stored() {
			if time.Now().After(deadline) {
				h.t.Errorf("%s may publish %s, but the message was not stored (violation: %v)", c.id.Name, subject, c.violated(subject, 0))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		h.count(true)
		return
	}
	if !c.violated(subject, 3*time.Second) {
		h.t.Errorf("%s must not publish %s: the server did not refuse it", c.id.Name, subject)
	}
	if stored() {
		h.t.Errorf("%s must not publish %s: the message was stored", c.id.Name, subject)
	}
	h.count(false)
}

// subscribe checks whether c may subscribe to subject (and receives what
// the operator publishes there).
func (h *harness) subscribe(c *client, subject string, want bool) {
	h.t.Helper()
	sub, err := c.nc.SubscribeSync(subject)
	if err != nil {
		h.t.Fatalf("%s: subscribe %s: %v", c.id.Name, subject, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := c.nc.Flush(); err != nil {
		h.t.Fatal(err)
	}
	if !want {
		if !c.violatedAs("subscription", subject, 3*time.Second) {
			h.t.Errorf("%s must not subscribe to %s: the server did not refuse it", c.id.Name, subject)
		}
		h.count(false)
		return
	}
	if c.violatedAs("subscription", subject, 50*time.Millisecond) {
		h.t.Errorf("%s may subscribe to %s, but the server refused it", c.id.Name, subject)
		return
	}
	pub := concrete(subject)
	if err := h.op.Conn().Publish(pub, []byte("x")); err != nil {
		h.t.Fatal(err)
	}
	if _, err := sub.NextMsg(3 * time.Second); err != nil {
		h.t.Errorf("%s subscribed to %s but did not receive %s: %v", c.id.Name, subject, pub, err)
	}
	h.count(true)
}

// consumer checks whether c may create a consumer on stream filtered to
// filter, under the only name its role may use.
func (h *harness) consumer(c *client, stream, filter string, want bool) {
	h.t.Helper()
	name := "svc-" + c.id.Name
	switch c.id.Role {
	case contracts.BusNode:
		name = contracts.NodeConsumer(c.id.Scope)
	case contracts.BusTenant:
		name = contracts.TenantConsumer(c.id.Scope)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := c.js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Name: name, FilterSubject: filter,
			AckPolicy: jetstream.AckExplicitPolicy, InactiveThreshold: time.Minute})
		done <- err
	}()
	api := "$JS.API.CONSUMER.CREATE." + stream + "." + name + "." + filter
	var err error
	select {
	case err = <-done:
	case <-func() chan struct{} {
		ch := make(chan struct{})
		go func() {
			if c.violated(api, 3*time.Second) {
				close(ch)
			}
		}()
		return ch
	}():
		err = errors.New("permissions violation")
	}
	if want {
		if err != nil {
			h.t.Errorf("%s may read %s on %s, but creating its consumer failed: %v", c.id.Name, filter, stream, err)
			return
		}
		dctx, dcancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer dcancel()
		_ = h.op.JetStream().DeleteConsumer(dctx, stream, name)
		h.count(true)
		return
	}
	if err == nil {
		h.t.Errorf("%s must not read %s on %s, but its consumer was created", c.id.Name, filter, stream)
		dctx, dcancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer dcancel()
		_ = h.op.JetStream().DeleteConsumer(dctx, stream, name)
	}
	h.count(false)
}

// concrete turns a subject with wildcards into one that matches it.
func concrete(subject string) string {
	toks := strings.Split(subject, ".")
	for i, t := range toks {
		if t == "*" || t == ">" {
			toks[i] = "x"
		}
	}
	return strings.Join(toks, ".")
}

const (
	targetNode   = "n1"
	targetTenant = "acme"
)

// subjectOf is the family's subject for the target node or tenant.
func subjectOf(f contracts.Family) string {
	switch f.Scope {
	case contracts.ScopeNode:
		return concrete(f.Scoped(targetNode))
	case contracts.ScopeTenant:
		return concrete(f.Scoped(targetTenant))
	}
	return concrete(f.Wildcard)
}

// filterOf is what a reader of the target scope subscribes to.
func filterOf(f contracts.Family) string {
	switch f.Scope {
	case contracts.ScopeNode:
		return f.Scoped(targetNode)
	case contracts.ScopeTenant:
		return f.Scoped(targetTenant)
	}
	return f.Wildcard
}

// mayPublish is may for publishing. A node agent publishes on a tenant's
// family (run output) only under its own node token (Family.NodeScoped),
// which the family's target subject here does not carry: that case is in
// TestServerRefusesForgeries.
func mayPublish(id contracts.Identity, f contracts.Family) bool {
	return may(id, f, f.Publishers)
}

// may is the table's answer: whether id may act on f's target subject.
func may(id contracts.Identity, f contracts.Family, roles []contracts.BusRole) bool {
	if id.Role == contracts.BusOperator {
		return true
	}
	if !slices.Contains(roles, id.Role) {
		return false
	}
	switch id.Role {
	case contracts.BusNode:
		return f.Scope == contracts.ScopeNode && id.Scope == targetNode
	case contracts.BusTenant:
		return f.Scope == contracts.ScopeTenant && id.Scope == targetTenant
	}
	return true
}

// mayConsume is whether id may create a consumer on f's stream filtered to
// f's target. Scoped identities (node agents, tenants) are held to the
// family's subjects; a service that reads any family of a stream may read
// the whole stream, since its consumers often filter several families
// (nats.go then puts no filter in the create subject for the server to
// check).
func mayConsume(id contracts.Identity, f contracts.Family) bool {
	if id.Role.Scoped() || id.Role == contracts.BusOperator {
		return may(id, f, f.Readers)
	}
	for _, g := range contracts.Families {
		if g.Stream == f.Stream && slices.Contains(g.Readers, id.Role) {
			return true
		}
	}
	return false
}

func identities() []contracts.Identity {
	var ids []contracts.Identity
	for _, r := range []contracts.BusRole{contracts.BusAdmin, contracts.BusScheduler, contracts.BusResourceManager,
		contracts.BusMonitor, contracts.BusAutoscaler, contracts.BusBilling, contracts.BusGateway, contracts.BusFleet} {
		ids = append(ids, contracts.Identity{Name: string(r), Role: r})
	}
	return append(ids,
		contracts.Identity{Name: "node-n1", Role: contracts.BusNode, Scope: targetNode},
		contracts.Identity{Name: "node-n2", Role: contracts.BusNode, Scope: "n2"},
		contracts.Identity{Name: "tenant-acme", Role: contracts.BusTenant, Scope: targetTenant},
		contracts.Identity{Name: "tenant-other", Role: contracts.BusTenant, Scope: "other"},
	)
}

// TestServerEnforcesAccessTable runs every subject family and KV bucket of
// contracts with every identity (each service, the admin, the simulated
// fleet, a node agent of the target node and of another, a tenant and
// another tenant) against a real nats-server: each publish, subscribe and
// consumer creation the table forbids must be refused by the server
// itself, and each it allows must work.
func TestServerEnforcesAccessTable(t *testing.T) {
	h := newHarness(t, identities())
	for _, f := range contracts.Families {
		subject, filter := subjectOf(f), filterOf(f)
		for _, id := range identities() {
			c := h.clients[id.Name]
			t.Run(fmt.Sprintf("%s/%s", f.Wildcard, id.Name), func(t *testing.T) {
				h.t = t
				h.publish(c, f.Stream, subject, mayPublish(id, f))
				h.subscribe(c, filter, may(id, f, f.Readers))
				h.consumer(c, f.Stream, filter, mayConsume(id, f))
			})
		}
		if f.NodeScoped == nil {
			continue
		}
		// A tenant family that node agents publish under their own node
		// token (run output: gp.logs.<tenant>.<job>.<node>): every
		// identity against the target node's subject.
		nodeSubject := strings.ReplaceAll(f.NodeScoped(targetNode), "*", "x")
		for _, id := range identities() {
			c := h.clients[id.Name]
			t.Run(fmt.Sprintf("%s/node-token/%s", f.Wildcard, id.Name), func(t *testing.T) {
				h.t = t
				want := slices.Contains(f.Publishers, id.Role) && !id.Role.Scoped() ||
					id.Role == contracts.BusNode && id.Scope == targetNode
				h.publish(c, f.Stream, nodeSubject, want)
			})
		}
	}
	for _, b := range contracts.Buckets {
		keys := []string{"k1"}
		if b.Bucket == contracts.BucketPriceBook {
			keys = append(keys, contracts.KeyMeteredUntil)
		}
		for _, id := range identities() {
			c := h.clients[id.Name]
			for _, key := range keys {
				t.Run(fmt.Sprintf("kv/%s/%s/%s", b.Bucket, key, id.Name), func(t *testing.T) {
					h.t = t
					want := slices.Contains(b.Writers, id.Role) || slices.Contains(b.KeyWriters[id.Role], key)
					h.publish(c, "KV_"+b.Bucket, "$KV."+b.Bucket+"."+key, want)
				})
			}
		}
	}
	h.t = t
	t.Logf("access table: %d subject x identity cases refused by the server, %d allowed", h.refused, h.allowed)
	if h.refused == 0 || h.allowed == 0 {
		t.Fatal("the table test checked nothing")
	}
}

// TestServerRefusesForgeries replays, identity by identity, each forgery
// the hostile-input probe of issue 12 got through before authentication:
// every one must be refused by the server.
func TestServerRefusesForgeries(t *testing.T) {
	h := newHarness(t, identities())
	cases := []struct {
		who, stream, subject string
	}{
		// A committed ledger entry or a plan from anyone but the resource
		// manager / scheduler (a node agent ran a forged command as root).
		{"node-n2", contracts.StreamAllocations, contracts.SubjectLedger("n1")},
		{"node-n1", contracts.StreamAllocations, contracts.SubjectLedger("n1")},
		{"tenant-acme", contracts.StreamAllocations, contracts.SubjectLedger("n1")},
		{"scheduler", contracts.StreamAllocations, contracts.SubjectLedger("n1")},
		{"gateway", contracts.StreamAllocations, contracts.SubjectLedger("n1")},
		{"tenant-acme", contracts.StreamPlans, contracts.SubjectPlan("scheduler")},
		{"node-n1", contracts.StreamPlans, contracts.SubjectPlan("scheduler")},
		{"gateway", contracts.StreamPlans, contracts.SubjectPlan("scheduler")},
		// Another tenant's run ended, stopped, cancelled, lost, succeeded.
		{"node-n2", contracts.StreamRuns, contracts.SubjectRuns("n1")},
		{"tenant-acme", contracts.StreamRuns, contracts.SubjectRuns("n1")},
		{"tenant-acme", contracts.StreamNodeCommands, contracts.SubjectNodeCommands("n1")},
		{"node-n2", contracts.StreamNodeCommands, contracts.SubjectNodeCommands("n1")},
		{"tenant-other", contracts.StreamJobs, contracts.SubjectCancel("acme")},
		{"tenant-acme", contracts.StreamNodes, contracts.SubjectNodeLifecycle("n1")},
		{"node-n1", contracts.StreamNodes, contracts.SubjectNodeLifecycle("n1")},
		{"tenant-acme", contracts.StreamJobEvents, contracts.SubjectJobEvents("acme", "j1")},
		{"gateway", contracts.StreamJobEvents, contracts.SubjectJobEvents("acme", "j1")},
		// A 1,000-GPU inventory, an empty one for a real node, forged
		// heartbeats.
		{"node-n2", contracts.StreamNodes, contracts.SubjectInventory("n1")},
		{"tenant-acme", contracts.StreamNodes, contracts.SubjectInventory("n9")},
		{"tenant-acme", contracts.StreamHeartbeats, contracts.SubjectHeartbeat("n9")},
		{"node-n2", contracts.StreamHeartbeats, contracts.SubjectHeartbeat("n1")},
		// Usage records (an invoice line of 999,999.00) and the price book.
		{"tenant-acme", contracts.StreamUsage, contracts.SubjectUsage("acme")},
		{"gateway", contracts.StreamUsage, contracts.SubjectUsage("acme")},
		{"node-n1", contracts.StreamUsage, contracts.SubjectUsage("acme")},
		{"tenant-acme", "KV_" + contracts.BucketPriceBook, "$KV." + contracts.BucketPriceBook + ".book"},
		{"billing", "KV_" + contracts.BucketPriceBook, "$KV." + contracts.BucketPriceBook + ".book"},
		{"tenant-acme", "KV_" + contracts.BucketQuotas, "$KV." + contracts.BucketQuotas + ".acme"},
		{"tenant-acme", "KV_" + contracts.BucketBudgets, "$KV." + contracts.BucketBudgets + ".acme"},
		{"scheduler", "KV_" + contracts.BucketQuotas, "$KV." + contracts.BucketQuotas + ".acme"},
		{"node-n1", "KV_" + contracts.BucketNodeAdmin, "$KV." + contracts.BucketNodeAdmin + ".n1"},
		// Run output of another node's runs.
		{"node-n2", contracts.StreamLogs, contracts.SubjectLogs("acme", "j1", "n1")},
		{"tenant-acme", contracts.StreamLogs, contracts.SubjectLogs("acme", "j1", "n1")},
		// Submits on a wildcard, an upper-case or another tenant's subject.
		{"tenant-acme", contracts.StreamJobs, "gp.jobs.submit.*"},
		{"tenant-acme", contracts.StreamJobs, "gp.jobs.submit.>"},
		{"tenant-acme", contracts.StreamJobs, "gp.jobs.submit.ACME"},
		{"tenant-acme", contracts.StreamJobs, "gp.jobs.submit." + strings.Repeat("a", 40)},
		{"tenant-acme", contracts.StreamJobs, contracts.SubjectSubmit("other")},
	}
	for _, tc := range cases {
		t.Run(tc.who+"/"+tc.subject, func(t *testing.T) {
			h.t = t
			h.publish(h.clients[tc.who], tc.stream, tc.subject, false)
		})
	}
	// What a node agent does publish: its own runs' output, of any tenant.
	t.Run("node-n1 ships its own output", func(t *testing.T) {
		h.t = t
		h.publish(h.clients["node-n1"], contracts.StreamLogs, contracts.SubjectLogs("acme", "j1", "n1"), true)
	})
	// Stream administration (purge, delete, edit) is the operator's alone.
	admin := []string{"STREAM.PURGE", "STREAM.DELETE", "STREAM.UPDATE", "STREAM.MSG.DELETE"}
	for _, id := range identities() {
		c := h.clients[id.Name]
		for _, op := range admin {
			for _, stream := range []string{contracts.StreamDeadLetters, contracts.StreamJobs} {
				subject := "$JS.API." + op + "." + stream
				t.Run(id.Name+"/"+subject, func(t *testing.T) {
					h.t = t
					if _, err := c.nc.Request(subject, []byte("{}"), 300*time.Millisecond); err == nil {
						t.Errorf("%s: %s answered", id.Name, subject)
					}
					if !c.violated(subject, 3*time.Second) {
						t.Errorf("%s must not call %s: the server did not refuse it", id.Name, subject)
					}
					h.count(false)
				})
			}
		}
	}
	// A node agent reads, pulls from and deletes its own consumers only:
	// not another node's, not a service's, and it gets no stream-wide
	// direct reads.
	for _, subject := range []string{
		"$JS.API.CONSUMER.MSG.NEXT." + contracts.StreamAllocations + "." + contracts.NodeConsumer("n2"),
		"$JS.API.CONSUMER.DELETE." + contracts.StreamAllocations + "." + contracts.NodeConsumer("n2"),
		"$JS.API.CONSUMER.MSG.NEXT." + contracts.StreamRuns + ".billing",
		"$JS.API.CONSUMER.DELETE." + contracts.StreamRuns + ".resource-manager-runs",
		"$JS.API.CONSUMER.MSG.NEXT." + contracts.StreamNodeCommands + "." + contracts.NodeReplayPrefix("n2") + "_1",
		"$JS.API.CONSUMER.CREATE." + contracts.StreamAllocations + "." + contracts.NodeConsumer("n1") + "." + contracts.SubjectLedgerAll,
		"$JS.API.DIRECT.GET." + contracts.StreamAllocations,
		"$JS.API.DIRECT.GET." + contracts.StreamAllocations + "." + contracts.SubjectLedger("n2"),
	} {
		t.Run("node-n1/"+subject, func(t *testing.T) {
			h.t = t
			c := h.clients["node-n1"]
			_, _ = c.nc.Request(subject, []byte(`{}`), 300*time.Millisecond)
			if !c.violated(subject, 3*time.Second) {
				t.Errorf("node-n1 may call %s", subject)
			}
			h.count(false)
		})
	}
	// A tenant cannot take over or read a service's consumer.
	t.Run("tenant reads a service consumer", func(t *testing.T) {
		h.t = t
		c := h.clients["tenant-acme"]
		subject := "$JS.API.CONSUMER.MSG.NEXT." + contracts.StreamJobEvents + ".gateway-events"
		_, _ = c.nc.Request(subject, []byte(`{"batch":1}`), 300*time.Millisecond)
		if !c.violated(subject, 3*time.Second) {
			t.Errorf("a tenant pulled from another consumer")
		}
		h.count(false)
	})
	h.t = t
	t.Logf("forgeries: %d refused by the server", h.refused)
}

// TestServerRefusesStrangers: no credentials, or credentials another trust
// signed, get no connection at all.
func TestServerRefusesStrangers(t *testing.T) {
	srv := natstest.StartWith(t, natsserver.Options{OnViolation: func(string) {}})
	if nc, err := nats.Connect(srv.URL(), nats.MaxReconnects(0)); err == nil {
		nc.Close()
		t.Fatal("a client without credentials connected")
	} else if !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("connect without credentials: %v, want an authorization violation", err)
	}
	other, err := natsauth.New()
	if err != nil {
		t.Fatal(err)
	}
	path, err := other.WriteCreds(t.TempDir(), contracts.Identity{Name: "operator", Role: contracts.BusOperator})
	if err != nil {
		t.Fatal(err)
	}
	if nc, err := nats.Connect(srv.URL(), nats.UserCredentials(path), nats.MaxReconnects(0)); err == nil {
		nc.Close()
		t.Fatal("a client with a foreign operator's credentials connected")
	}
}
