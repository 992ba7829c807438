package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/freeport"
	"github.com/gpuplane/gpuplane/libs/natsauth"
)

// natsNode is one nats-server of the three-node cluster.
type natsNode struct {
	*proc
	clientPort, routePort, httpPort int
	// clientURL is what services dial: the node's own port, or its
	// proxy for the partitionable node.
	clientURL string
}

// natsCluster is three nats-server processes, clustered on loopback, with
// JetStream (sync_interval: always) and the operator-mode trust of
// libs/natsauth. Node 2 can be partitioned: its client port and every
// route to and from it pass through proxies (proxy.go).
type natsCluster struct {
	nodes   [3]*natsNode
	proxies []*Proxy // of node 2
	trust   *natsauth.Trust
	creds   string // directory of the creds files
}

// partitioned is the index of the node whose links go through proxies.
const partitioned = 2

// startNATS writes the trust, the creds and the three server configs
// under dir and starts the servers.
func startNATS(t *testing.T, bin, dir string) *natsCluster {
	t.Helper()
	trust, err := natsauth.New()
	if err != nil {
		t.Fatal(err)
	}
	// The same files gpuplane-creds writes: auth.conf for the servers,
	// a creds file per identity.
	credsDir := filepath.Join(dir, "creds")
	if _, err := trust.WriteServerConfig(credsDir); err != nil {
		t.Fatal(err)
	}
	c := &natsCluster{trust: trust, creds: credsDir}
	for i := range c.nodes {
		c.nodes[i] = &natsNode{clientPort: freeport.Port(t), routePort: freeport.Port(t), httpPort: freeport.Port(t)}
	}
	proxy := func(port int) *Proxy {
		p, err := NewProxy(fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			t.Fatal(err)
		}
		c.proxies = append(c.proxies, p)
		t.Cleanup(func() { _ = p.Close() })
		return p
	}
	p := c.nodes[partitioned]
	clientProxy := proxy(p.clientPort)
	inbound := proxy(p.routePort) // the others' routes to node 2
	outbound := map[int]*Proxy{}  // node 2's routes to the others
	for i, n := range c.nodes {
		if i != partitioned {
			outbound[i] = proxy(n.routePort)
		}
		n.clientURL = fmt.Sprintf("nats://127.0.0.1:%d", n.clientPort)
	}
	p.clientURL = "nats://" + clientProxy.Addr()

	for i, n := range c.nodes {
		var routes []string
		advertise := ""
		for j, m := range c.nodes {
			switch {
			case j == i:
			case i == partitioned:
				routes = append(routes, "nats-route://"+outbound[j].Addr())
			case j == partitioned:
				routes = append(routes, "nats-route://"+inbound.Addr())
			default:
				routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", m.routePort))
			}
		}
		// Every route is configured (each node names both peers), so no
		// node needs gossip to find the others; a gossiped route URL would
		// be dialled directly, past node 2's proxies (a partition that
		// leaks). Advertising port 1, where nothing listens, makes any such
		// implicit route fail at once.
		advertise = "\n  advertise: \"127.0.0.1:1\""

		store := filepath.Join(dir, fmt.Sprintf("n%d", i))
		conf := fmt.Sprintf(`# chaos suite node %d: deploy/nats/nats-server.conf's shape on loopback,
# without TLS (the suite tests faults, not certificates).
server_name: n%d
listen: 127.0.0.1:%d
http: 127.0.0.1:%d
max_control_line: 32KB
max_payload: 1MB
jetstream {
  store_dir: %q
  # fsync every write, as Jepsen's analysis of NATS 2.12 advises: a
  # SIGKILLed node must not come back having lost acknowledged writes.
  sync_interval: always
}
cluster {
  name: chaos
  listen: 127.0.0.1:%d%s
  # Clients learn no other server's URL from a server: they dial only the
  # URLs they were given, so node 2 is reached only through its proxy.
  no_advertise: true
  routes: [
    %s
  ]
}
include "creds/auth.conf"
`, i, i, n.clientPort, n.httpPort, store, n.routePort, advertise, strings.Join(routes, "\n    "))
		path := filepath.Join(dir, fmt.Sprintf("n%d.conf", i))
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		n.proc = newProc(t, dir, fmt.Sprintf("nats-%d", i), "nats", filepath.Join(bin, "nats-server"), []string{"-c", path}, os.Environ())
	}
	t.Cleanup(func() {
		for _, n := range c.nodes {
			if err := n.shutdown(); err != nil {
				t.Error(err)
			}
			if t.Failed() {
				t.Logf("--- %s log (last 20 lines) ---\n%s", n.name, n.tail(20))
			}
		}
	})
	for _, n := range c.nodes {
		if err := n.start(); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(time.Minute)
	for _, n := range c.nodes {
		for !n.healthy(context.Background()) {
			if time.Now().After(deadline) {
				t.Fatalf("%s not healthy after a minute:\n%s", n.name, n.tail(30))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return c
}

// healthy is the node's /healthz: it answers 200 once JetStream is up
// and, after a restart, its streams have caught up with the others.
func (n *natsNode) healthy(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/healthz", n.httpPort), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// URLs is the comma-separated list services dial (nats.go fails over
// along it and shuffles it per connection).
func (c *natsCluster) URLs() string {
	var u []string
	for _, n := range c.nodes {
		u = append(u, n.clientURL)
	}
	return strings.Join(u, ",")
}

// routed reports whether node from has a route to node to now (its
// /routez names it as a remote); true when it cannot tell.
func (c *natsCluster) routed(ctx context.Context, from, to int) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/routez", c.nodes[from].httpPort), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return true
	}
	defer resp.Body.Close()
	var rz struct {
		Routes []struct {
			RemoteName string `json:"remote_name"`
		} `json:"routes"`
	}
	if json.NewDecoder(resp.Body).Decode(&rz) != nil {
		return true
	}
	for _, r := range rz.Routes {
		if r.RemoteName == fmt.Sprintf("n%d", to) {
			return true
		}
	}
	return false
}

// credsFor mints id's creds file.
func (c *natsCluster) credsFor(t *testing.T, id contracts.Identity) string {
	t.Helper()
	p, err := c.trust.WriteCreds(c.creds, id)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// cut isolates node 2 from its peers and its clients; heal undoes it. cut
// returns the links it closed.
func (c *natsCluster) cut() int {
	n := 0
	for _, p := range c.proxies {
		n += p.Cut()
	}
	return n
}

func (c *natsCluster) heal() {
	for _, p := range c.proxies {
		p.Heal()
	}
}

// redis is billing's redis-server; killing it loses everything (no
// persistence), as a flushed Redis does.
type redis struct {
	*proc
	port int
}

// startRedis starts redis-server on a free port, or skips when it is not
// installed (fails under GPUPLANE_REQUIRE_REDIS=1, as CI sets).
func startRedis(t *testing.T, dir string) *redis {
	t.Helper()
	path, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("GPUPLANE_REQUIRE_REDIS") == "1" {
			t.Fatal("redis-server not found and GPUPLANE_REQUIRE_REDIS=1")
		}
		t.Skip("redis-server not found: the chaos suite bills on a real Redis")
	}
	r := &redis{port: freeport.Port(t)}
	r.proc = newProc(t, dir, "redis", "redis", path,
		[]string{"--bind", "127.0.0.1", "--port", fmt.Sprint(r.port), "--save", "", "--appendonly", "no"}, os.Environ())
	t.Cleanup(func() { _ = r.shutdown() })
	if err := r.start(); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *redis) addr() string { return fmt.Sprintf("127.0.0.1:%d", r.port) }

// flush empties the running Redis (FLUSHALL).
func (r *redis) flush(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "redis-cli", "-p", fmt.Sprint(r.port), "FLUSHALL").CombinedOutput()
	if err != nil {
		return fmt.Errorf("redis FLUSHALL: %v: %s", err, out)
	}
	return nil
}
