package natstest

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/freeport"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
)

// Minter mints credentials: a single server and a cluster both do, so
// Creds, Operator, Service, Node and Tenant take either.
type Minter interface {
	Creds(id contracts.Identity) (string, error)
}

// Cluster is n embedded NATS servers in one process, clustered over
// routes on 127.0.0.1 with JetStream clustered, as production runs three
// nats-server processes. Every member trusts the same operator, so creds
// from Creds work on any of them. Kill and Restart take a member down
// and bring it back on the same ports and store, as a crashed and
// restarted nats-server would be.
type Cluster struct {
	t testing.TB
	// Trust is the operator and accounts every member trusts.
	Trust *natsauth.Trust
	// Servers are the members; a killed member's entry stays until
	// Restart replaces it.
	Servers []*natsserver.Server

	// proxies[i][j] carries the routes member i opens to member j
	// (WithPartitions); nil otherwise.
	proxies [][]*routeProxy

	mu       sync.Mutex
	opts     []natsserver.Options
	down     []bool
	credsDir string
	creds    map[contracts.Identity]string
}

// StartCluster starts an n-member cluster for t and waits until
// JetStream has a meta leader that counts every member and each member is
// current, so an R3 stream can be created at once. It is shut down when t
// ends. ClusterWith sets more options (SyncAlways).
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	return StartClusterWith(t, n, natsserver.Options{})
}

// StartClusterWith starts an n-member cluster whose members share o's
// settings (SyncAlways, MaxMemory, Trust, OnViolation); names, ports,
// store directories and routes are the cluster's own.
func StartClusterWith(t testing.TB, n int, o natsserver.Options, opts ...ClusterOption) *Cluster {
	t.Helper()
	var cc clusterConfig
	for _, opt := range opts {
		opt(&cc)
	}
	if n < 1 {
		t.Fatalf("StartCluster: %d members", n)
	}
	if o.Trust == nil {
		tr, err := natsauth.New()
		if err != nil {
			t.Fatal(err)
		}
		o.Trust = tr
	}
	if o.OnViolation == nil {
		o.OnViolation = failOnViolation(t)
	}
	// Ports are chosen up front, not -1 per server: every member's
	// routes name every other's, and a restarted member must come back
	// where the others' routes and the clients' URL lists look for it.
	ports := freeport.Ports(t, 2*n)
	routes := make([]string, n)
	for i := range n {
		routes[i] = fmt.Sprintf("nats-route://127.0.0.1:%d", ports[n+i])
	}
	c := &Cluster{
		t:        t,
		Trust:    o.Trust,
		Servers:  make([]*natsserver.Server, n),
		opts:     make([]natsserver.Options, n),
		down:     make([]bool, n),
		credsDir: filepath.Join(t.TempDir(), "creds"),
		creds:    map[contracts.Identity]string{},
	}
	t.Cleanup(c.shutdown)
	if cc.partitions {
		c.proxies = make([][]*routeProxy, n)
		for i := range n {
			c.proxies[i] = make([]*routeProxy, n)
			for j := range n {
				if j != i {
					c.proxies[i][j] = newRouteProxy(t, fmt.Sprintf("127.0.0.1:%d", ports[n+j]))
				}
			}
		}
	}
	for i := range n {
		mo := o
		mo.Host = "127.0.0.1"
		mo.Name = fmt.Sprintf("gpuplane-n%d", i+1)
		mo.Port = ports[i]
		mo.ClusterName = "gpuplane-test"
		mo.ClusterPort = ports[n+i]
		mo.Routes = routes
		if c.proxies != nil {
			// Member i reaches each other member only through its
			// proxy, and advertises a route address nobody listens on:
			// a member told of another by gossip must not connect to
			// it around the proxies (its one try is refused).
			mo.Routes = nil
			for j := range n {
				if j != i {
					mo.Routes = append(mo.Routes, "nats-route://"+c.proxies[i][j].addr())
				}
			}
			mo.ClusterAdvertise = "127.0.0.1:1"
		}
		mo.StoreDir = t.TempDir()
		c.opts[i] = mo
	}
	// Members start together: each waits for its routes, and a member
	// started alone would not see the others until they exist anyway.
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c.Servers[i], errs[i] = natsserver.Start(ctx, c.opts[i])
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("start nats cluster member %d: %v", i+1, err)
		}
	}
	c.WaitReady()
	return c
}

// failOnViolation fails t on each access the servers refused (see
// StartWith) until t ends.
func failOnViolation(t testing.TB) func(string) {
	var mu sync.Mutex
	done := false
	t.Cleanup(func() { mu.Lock(); done = true; mu.Unlock() })
	return func(msg string) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case done:
		case strings.Contains(msg, "authentication error"):
			// Creds this server's operator never signed: a stranger, not
			// one of the test's identities overstepping. Test packages run
			// side by side, and a client of another package's server
			// (killed, restarted) reconnects to a port this server was
			// then given; it failed an unrelated e2e test in CI. Our own
			// identities' creds always authenticate, or nothing would run.
			t.Logf("nats refused a stranger: %s", msg)
		default:
			t.Errorf("nats refused access: %s", msg)
		}
	}
}

// URLs is every member's client URL, comma separated: a client given it
// fails over to another member when its own dies. Killed members are in
// it too (their ports come back with Restart).
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.opts))
	for i, o := range c.opts {
		urls[i] = fmt.Sprintf("nats://127.0.0.1:%d", o.Port)
	}
	return strings.Join(urls, ",")
}

// URL is member i's client URL alone (a client that must talk to that
// member, or one to be cut off by its death).
func (c *Cluster) URL(i int) string { return fmt.Sprintf("nats://127.0.0.1:%d", c.opts[i].Port) }

// Creds returns the path of a creds file of id, valid on every member.
func (c *Cluster) Creds(id contracts.Identity) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p, ok := c.creds[id]; ok {
		return p, nil
	}
	p, err := c.Trust.WriteCreds(c.credsDir, id)
	if err != nil {
		return "", err
	}
	c.creds[id] = p
	return p, nil
}

// Kill stops member i (its store stays for Restart). Clients connected to
// it reconnect to another member of their URL list.
func (c *Cluster) Kill(i int) {
	c.t.Helper()
	c.mu.Lock()
	s, down := c.Servers[i], c.down[i]
	c.down[i] = true
	c.mu.Unlock()
	if !down {
		s.Shutdown()
	}
}

// Restart starts member i again on its ports and store and waits until
// the cluster is whole and current again.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	c.mu.Lock()
	down := c.down[i]
	c.mu.Unlock()
	if !down {
		c.t.Fatalf("Restart(%d): member is running", i)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := natsserver.Start(ctx, c.opts[i])
	if err != nil {
		c.t.Fatalf("restart nats cluster member %d: %v", i+1, err)
	}
	c.mu.Lock()
	c.Servers[i], c.down[i] = s, false
	c.mu.Unlock()
	c.WaitReady()
}

// Running reports whether member i is up.
func (c *Cluster) Running(i int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.down[i]
}

// Leader is the index of the JetStream meta leader, or -1 while there is
// none.
func (c *Cluster) Leader() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range c.Servers {
		if !c.down[i] && s.JetStreamIsLeader() {
			return i
		}
	}
	return -1
}

// StreamLeader is the index of the member leading stream of the platform
// account, or -1 while it has none.
func (c *Cluster) StreamLeader(stream string) int {
	acc := c.Trust.AccountPublicKey()
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range c.Servers {
		if !c.down[i] && s.JetStreamIsStreamLeader(acc, stream) {
			return i
		}
	}
	return -1
}

// ConsumerLeader is the index of the member leading the durable consumer
// of stream, or -1 while it has none.
func (c *Cluster) ConsumerLeader(stream, consumer string) int {
	acc := c.Trust.AccountPublicKey()
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, s := range c.Servers {
		if !c.down[i] && s.JetStreamIsConsumerLeader(acc, stream, consumer) {
			return i
		}
	}
	return -1
}

// WaitReady waits (at most 30 s, then fails t) until JetStream has a meta
// leader that counts every running member as a peer and every running
// member is current with it.
func (c *Cluster) WaitReady() {
	c.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if c.ready() {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	c.t.Fatalf("nats cluster: no JetStream meta leader with every member current within 30s")
}

func (c *Cluster) ready() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	running := 0
	var leader *natsserver.Server
	for i, s := range c.Servers {
		if c.down[i] {
			continue
		}
		running++
		if s.JetStreamIsLeader() {
			leader = s
		}
	}
	// The leader counts the peers it has heard from lately; fewer than
	// are running means one has not joined (or rejoined) yet.
	if leader == nil || len(leader.JetStreamClusterPeers()) < running {
		return false
	}
	for i, s := range c.Servers {
		if !c.down[i] && !s.JetStreamIsCurrent() {
			return false
		}
	}
	return true
}

func (c *Cluster) shutdown() {
	var wg sync.WaitGroup
	for i, s := range c.Servers {
		if s == nil || !c.Running(i) {
			continue
		}
		wg.Go(s.Shutdown)
	}
	wg.Wait()
	for _, row := range c.proxies {
		for _, p := range row {
			if p != nil {
				p.close()
			}
		}
	}
}
