package chaos

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/freeport"
	"github.com/gpuplane/gpuplane/libs/natsauth"
)

// tier is how big a run is: the small tier runs under make test (fixed
// seed, about a minute of faults on 8 machines), the full one under
// make chaos (random seed, four minutes on 40 machines).
type tier struct {
	name           string
	seed           uint64
	warmup, faults time.Duration
	machines       int     // per fleet-sim process; there are two
	rate           float64 // jobs submitted per second
	drain          time.Duration
}

func chooseTier(t *testing.T) tier {
	t.Helper()
	tr := tier{name: "small", seed: 13, warmup: 15 * time.Second, faults: 60 * time.Second, machines: 4, rate: 2.5, drain: 3 * time.Minute}
	if os.Getenv("GPUPLANE_CHAOS_FULL") == "1" {
		tr = tier{name: "full", seed: uint64(time.Now().UnixNano()), warmup: 30 * time.Second, faults: 4 * time.Minute, machines: 20, rate: 5, drain: 5 * time.Minute}
	}
	if v := os.Getenv("GPUPLANE_CHAOS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("GPUPLANE_CHAOS_SEED: %v", err)
		}
		tr.seed = s
	}
	if v := os.Getenv("CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("CHAOS_DURATION: %v", err)
		}
		tr.faults = d
	}
	return tr
}

// svc is one service replica the suite runs.
type svc struct {
	*proc
	role contracts.BusRole
	// probe, when set, is the replica's /healthz: its first 200 after a
	// fault is its recovery (gateway, monitor).
	probe string
	nodes []string // fleet-sim: the machines it runs
}

// fleetYAML is one fleet-sim process's machines: count 8×H100 machines
// in pool, named <pool>-01...
func fleetYAML(pool, zone string, count int) string {
	return fmt.Sprintf(`machineTypes:
  hgx-h100-8:
    gpuModel: H100-80GB
    gpuCount: 8
    nvlink: true
pools:
  - name: %s
    machineType: hgx-h100-8
    count: %d
    zone: %s
    priceClass: on-demand
`, pool, count, zone)
}

// replicasOf is how many replicas of each service run: two where the
// service supports it (the scheduler on its lease; billing, monitor and
// the gateway active/active), one of the resource manager and the
// autoscaler until their -h shows a lease. CHAOS_REPLICAS
// (resource-manager=2,...) overrides.
func replicasOf(t *testing.T, bin string) map[string]int {
	t.Helper()
	n := map[string]int{"scheduler": 2, "resource-manager": 1, "billing": 2, "monitor": 2, "autoscaler": 1, "gateway": 2}
	for _, s := range []string{"resource-manager", "autoscaler"} {
		out, _ := exec.Command(filepath.Join(bin, s), "-h").CombinedOutput()
		if strings.Contains(string(out), "-lease") {
			n[s] = 2
		}
	}
	for kv := range strings.SplitSeq(os.Getenv("CHAOS_REPLICAS"), ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		c, err := strconv.Atoi(v)
		if err != nil || c < 1 {
			t.Fatalf("CHAOS_REPLICAS: %q", kv)
		}
		n[k] = c
	}
	return n
}

// platform is everything the suite started.
type platform struct {
	nats     *natsCluster
	redis    *redis
	svcs     []*svc
	byName   map[string]*svc
	nc       *nats.Conn
	js       jetstream.JetStream
	gwToken  string
	gateways []string
	rec      *recorder
}

func startPlatform(t *testing.T, tr tier, bin, dir string) *platform {
	t.Helper()
	p := &platform{byName: map[string]*svc{}}
	p.nats = startNATS(t, bin, dir)
	p.redis = startRedis(t, dir)
	reps := replicasOf(t, bin)
	t.Logf("replicas: %v", reps)

	env := append(os.Environ(), "GPUPLANE_NATS_URL="+p.nats.URLs(), "GPUPLANE_STREAM_REPLICAS=3",
		"GPUPLANE_LOG_LEVEL="+cmp.Or(os.Getenv("CHAOS_LOG_LEVEL"), "warn"), "GPUPLANE_OTLP_ENDPOINT=")
	add := func(name, kind string, role contracts.BusRole, args ...string) *svc {
		creds := p.nats.credsFor(t, contracts.Identity{Name: name, Role: role})
		senv := append(slices.Clip(env), "GPUPLANE_NATS_CREDS="+creds)
		if kind == "scheduler" && os.Getenv("CHAOS_LOG_LEVEL") == "" {
			// At info a scheduler logs where each rebuild's replays ended
			// and what it preempted: what a stuck or forgotten job is read
			// from. A few lines a term. (The last of a key counts.)
			senv = append(senv, "GPUPLANE_LOG_LEVEL=info")
		}
		s := &svc{proc: newProc(t, dir, name, kind, filepath.Join(bin, kind), args, senv), role: role}
		p.svcs = append(p.svcs, s)
		p.byName[name] = s
		return s
	}
	for i, pool := range []string{"h100a", "h100b"} {
		path := filepath.Join(dir, pool+".yaml")
		if err := os.WriteFile(path, []byte(fleetYAML(pool, fmt.Sprintf("zone-%c", 'a'+i), tr.machines)), 0o644); err != nil {
			t.Fatal(err)
		}
		s := add("fleet-sim-"+pool, "fleet-sim", contracts.BusFleet, "-fleet", path, "-log-dir", filepath.Join(dir, "runs-"+pool),
			"-checkpoint-dir", filepath.Join(dir, "checkpoints"))
		for m := 1; m <= tr.machines; m++ {
			s.nodes = append(s.nodes, fmt.Sprintf("%s-%02d", pool, m))
		}
	}
	replica := func(kind string, i int) string {
		if i == 0 {
			return kind
		}
		return fmt.Sprintf("%s-%c", kind, 'a'+i)
	}
	for i := range reps["resource-manager"] {
		add(replica("resource-manager", i), "resource-manager", contracts.BusResourceManager, "-name", replica("resource-manager", i))
	}
	for i := range reps["scheduler"] {
		// One -name: one lease. The workload has host commands, which
		// pools without a runtime policy run only with -allow-host-commands.
		add(replica("scheduler", i), "scheduler", contracts.BusScheduler, "-allow-host-commands")
	}
	for i := range reps["billing"] {
		add(replica("billing", i), "billing", contracts.BusBilling, "-redis", p.redis.addr())
	}
	for i := range reps["monitor"] {
		addr := freeport.Addr(t)
		add(replica("monitor", i), "monitor", contracts.BusMonitor, "-addr", addr).probe = "http://" + addr + "/healthz"
	}
	for i := range reps["autoscaler"] {
		add(replica("autoscaler", i), "autoscaler", contracts.BusAutoscaler)
	}
	tokenFile := filepath.Join(dir, "admin.token")
	for i := range reps["gateway"] {
		addr := freeport.Addr(t)
		add(replica("gateway", i), "gateway", contracts.BusGateway, "-addr", addr, "-admin-token-file", tokenFile).probe = "http://" + addr + "/healthz"
		p.gateways = append(p.gateways, "http://"+addr)
	}
	t.Cleanup(func() {
		for _, s := range slices.Backward(p.svcs) {
			if err := s.shutdown(); err != nil {
				t.Error(err)
			}
			if t.Failed() {
				t.Logf("--- %s log (last 30 lines) ---\n%s", s.name, s.tail(30))
			}
			_ = s.log.Close()
		}
	})

	// Every service at once, as a cluster starts; the gateways after the
	// first has written the admin token both use.
	for _, s := range p.svcs {
		if s.kind == "gateway" && s.name != "gateway" {
			continue
		}
		if err := s.start(); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 4*time.Minute, "the first gateway's admin token", func() (bool, string) {
		b, err := os.ReadFile(tokenFile)
		p.gwToken = strings.TrimSpace(string(b))
		return err == nil && p.gwToken != "", fmt.Sprint(err)
	})
	for _, s := range p.svcs {
		if s.kind == "gateway" && s.name != "gateway" {
			if err := s.start(); err != nil {
				t.Fatal(err)
			}
		}
	}

	opCreds := p.nats.credsFor(t, contracts.Identity{Name: "chaos-operator", Role: contracts.BusOperator})
	opts, err := natsauth.ClientOptions(opCreds)
	if err != nil {
		t.Fatal(err)
	}
	p.nc, err = nats.Connect(p.nats.URLs(), append(opts, nats.Name("chaos-client"), nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond), nats.RetryOnFailedConnect(true))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.nc.Close)
	if p.js, err = jetstream.New(p.nc); err != nil {
		t.Fatal(err)
	}
	return p
}

// waitFor polls cond every 100 ms until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	if msg, ok := poll(d, cond); !ok {
		t.Fatalf("timed out after %s waiting for %s: %s", d, what, msg)
	}
}

// poll is waitFor that reports instead of failing.
func poll(d time.Duration, cond func() (bool, string)) (string, bool) {
	deadline := time.Now().Add(d)
	var msg string
	for {
		var ok bool
		if ok, msg = cond(); ok {
			return msg, true
		}
		if time.Now().After(deadline) {
			return msg, false
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// httpOK is whether GET url answers 200 within a second.
func httpOK(ctx context.Context, url string) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// logDir is where the processes' logs, configs and JetStream stores go:
// kept after a failed run, or always with CHAOS_KEEP=1, and named in the
// log; removed after a passing one.
func logDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "gpuplane-chaos-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("CHAOS_KEEP") == "1" {
			t.Logf("logs, configs and stores kept in %s", dir)
			return
		}
		_ = os.RemoveAll(dir)
	})
	return dir
}
