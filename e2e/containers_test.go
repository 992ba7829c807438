package e2e

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// Jobs as container images (issue 14), end to end: the whole platform in
// this process, real registries (go-containerregistry's, one anonymous,
// one behind a basic-auth login) on 127.0.0.1, images built here from
// Debian's busybox-static, and the node agents running them with runc.

// requireRuncEnv makes a machine that cannot run containers a failure
// instead of a skip (.ci/run sets it where it runs as root).
const requireRuncEnv = "GPUPLANE_REQUIRE_RUNC"

// requireContainers returns the static busybox the test images are built
// from; it skips the test, saying why, where containers cannot run here
// (not root, no runc, no static busybox), or fails it under
// GPUPLANE_REQUIRE_RUNC=1.
func requireContainers(t *testing.T) string {
	t.Helper()
	bb, why := containerSupport()
	if why != "" {
		if os.Getenv(requireRuncEnv) == "1" {
			t.Fatalf("container tests cannot run: %s, and %s=1 requires them to", why, requireRuncEnv)
		}
		skipFor(t, fmt.Sprintf("container tests skipped: %s (%s=1 makes this a failure)", why, requireRuncEnv))
	}
	return bb
}

// containerSupport is the static busybox to build test images from, and
// why containers cannot run here ("" when they can).
func containerSupport() (busybox, why string) {
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "not root (runc needs root to create containers)")
	}
	if _, err := exec.LookPath("runc"); err != nil {
		if _, err := os.Stat("/usr/sbin/runc"); err != nil {
			missing = append(missing, "no runc in PATH or /usr/sbin (Debian: apt-get install runc)")
		}
	}
	bb, err := gpuplane.FindBusybox()
	if err != nil {
		missing = append(missing, err.Error())
	}
	return bb, strings.Join(missing, "; ")
}

// testRegistry is a registry on 127.0.0.1 (so go-containerregistry talks
// plain HTTP to it); with a user it asks every request for that basic-auth
// login, as a private registry does.
type testRegistry struct {
	host, user, password string
}

func startRegistry(t testing.TB, user, password string) *testRegistry {
	t.Helper()
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	if user != "" {
		inner := h
		want := "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
		h = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != want {
				w.Header().Set("WWW-Authenticate", `Basic realm="e2e"`)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				_, _ = w.Write([]byte(`{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`))
				return
			}
			inner.ServeHTTP(w, r)
		})
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &testRegistry{host: strings.TrimPrefix(srv.URL, "http://"), user: user, password: password}
}

// push stores img as repo:tag and returns the reference.
func (r *testRegistry) push(t testing.TB, repoTag string, img v1.Image) string {
	t.Helper()
	ref := r.host + "/" + repoTag
	auth := authn.Anonymous
	if r.user != "" {
		auth = &authn.Basic{Username: r.user, Password: r.password}
	}
	parsed, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(parsed, img, remote.WithAuth(auth)); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	return ref
}

// busyboxImage is gpuplane.BusyboxImage with extra files.
func busyboxImage(t testing.TB, bb string, extra map[string]string) v1.Image {
	t.Helper()
	img, err := gpuplane.BusyboxImage(bb, extra)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func digestOf(t testing.TB, img v1.Image) string {
	t.Helper()
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d.String()
}

// The external agents run as processes of their own (this test binary
// in agent mode), so a test can kill one with SIGKILL mid-run and start
// it again, as a machine's agent dies and systemd restarts it.
const envRunAgent = "GPUPLANE_E2E_RUN_AGENT"

// runAgentMain runs a node agent with the node-agent command's flags
// until SIGTERM or SIGINT; TestMain calls it in agent mode.
func runAgentMain(args []string) int {
	cfg := nodeagent.DefaultConfig()
	fs := flag.NewFlagSet("node-agent", flag.ContinueOnError)
	cfg.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if err := nodeagent.Run(ctx, cfg, log); err != nil && !errors.Is(err, context.Canceled) {
		log.Error("node agent", "err", err)
		return 1
	}
	return 0
}

// agentProc is a node agent process of a test.
type agentProc struct {
	t       testing.TB
	args    []string
	logPath string
	cmd     *exec.Cmd
	exited  chan struct{}
}

// startAgent starts node's agent as a process on the stack's bus with
// its own node-agent identity (see withNodeIdentities), pool and log
// directory, simulating GPUs (-gpu-model, -gpu-count in args).
func startAgent(t testing.TB, s *stack, node string, args ...string) *agentProc {
	t.Helper()
	logDir := t.TempDir()
	a := &agentProc{t: t, logPath: filepath.Join(t.TempDir(), node+".log"),
		args: append([]string{"-nats", s.ep.NATSURL, "-creds", s.ep.Creds["node-"+node], "-node-id", node,
			"-log-dir", logDir, "-heartbeat-interval", "500ms", "-stop-grace", "5s"}, args...)}
	a.start()
	t.Cleanup(func() {
		a.stop()
		if t.Failed() {
			b, _ := os.ReadFile(a.logPath)
			t.Logf("agent %s's log (last 3 KiB):\n%s", node, tail(string(b), 3072))
		}
	})
	return a
}

func (a *agentProc) start() {
	a.t.Helper()
	self, err := os.Executable()
	if err != nil {
		a.t.Fatal(err)
	}
	logFile, err := os.OpenFile(a.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		a.t.Fatal(err)
	}
	a.cmd = exec.Command(self, a.args...)
	a.cmd.Env = append(os.Environ(), envRunAgent+"=1")
	a.cmd.Stdout, a.cmd.Stderr = logFile, logFile
	if err := a.cmd.Start(); err != nil {
		a.t.Fatal(err)
	}
	a.exited = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		_ = cmd.Wait()
		_ = logFile.Close()
		close(done)
	}(a.cmd, a.exited)
}

// kill ends the agent at once (SIGKILL), leaving its runs' shims and
// containers running.
func (a *agentProc) kill() {
	_ = a.cmd.Process.Signal(syscall.SIGKILL)
	<-a.exited
}

func (a *agentProc) stop() {
	select {
	case <-a.exited:
		return
	default:
	}
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-a.exited:
	case <-time.After(20 * time.Second):
		a.kill()
	}
}

// withNodeIdentities adds a node-agent bus identity per node
// ("node-<node>", scoped to it), for agents run as processes.
func withNodeIdentities(nodes ...string) func(*gpuplane.Config) {
	return func(c *gpuplane.Config) {
		ids := slices.Clone(c.Identities.Identities)
		for _, n := range nodes {
			ids = append(ids, natsauth.DescribedIdentity{Name: "node-" + n, Role: "node-agent", Scope: n})
		}
		c.Identities = natsauth.Description{Identities: ids}
	}
}

// setPoolRuntime stores pool's runtime policy through the gateway and
// waits until the scheduler applies it: a probe job with a mount under
// the policy's first root is no longer rejected with mount_not_allowed.
func setPoolRuntime(t testing.TB, s *stack, h *history, pool string, rt contracts.PoolRuntime, image string) {
	t.Helper()
	if code, b := s.callAPI(t, http.MethodPut, "/v1/pools/"+pool, contracts.PoolConfig{Pool: pool, Policy: contracts.PolicyBinpack, Runtime: &rt}, nil); code/100 != 2 {
		t.Fatalf("PUT /v1/pools/%s: %d %s", pool, code, b)
	}
	if len(rt.MountRoots) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 0; ; i++ {
		id := fmt.Sprintf("probe-%s-%d", pool, i)
		s.submitJob(t, ctx, "acme", contracts.JobRequest{ID: id, Pool: pool,
			Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: contracts.GPUModelAny}},
			Run: contracts.RunSpec{Image: image, Command: []string{"true"},
				Mounts: []contracts.Mount{{Source: rt.MountRoots[0], Target: "/probe", ReadOnly: true}}}})
		first := h.await(t, 30*time.Second, "acme/"+id, "accepted or rejected", func(ev contracts.JobEvent) bool {
			return ev.Type == contracts.EventQueued || ev.Type == contracts.EventRejected
		})
		if first.Type == contracts.EventQueued {
			h.await(t, 60*time.Second, "acme/"+id, "its end", func(ev contracts.JobEvent) bool { return ev.State.Terminal() })
			return
		}
		if first.Reason != contracts.ReasonMountNotAllowed || ctx.Err() != nil {
			t.Fatalf("probe %s of pool %s's policy: %s %s: %s", id, pool, first.Type, first.Reason, first.Message)
		}
		time.Sleep(100 * time.Millisecond) // the scheduler has not read the policy yet
	}
}

// containerJob is a one-GPU container job of tenant acme in pool.
func containerJob(id, pool, model, image string, script string) contracts.JobRequest {
	return contracts.JobRequest{ID: id, Pool: pool,
		Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: model}},
		Run:       contracts.RunSpec{Image: image, Command: []string{"sh", "-c", script}, Duration: contracts.Duration(2 * time.Minute)}}
}

// withSignals mounts the host's signals directory read-only at /signals:
// a job waits there for the test's go.
func withSignals(req contracts.JobRequest, signals string) contracts.JobRequest {
	req.Run.Mounts = append(req.Run.Mounts, contracts.Mount{Source: signals, Target: "/signals", ReadOnly: true})
	return req
}

// containerFleet: ctr (one 4×L4 machine) runs most container jobs, gc (one
// 2×T4 machine) the cache's garbage collection, so no other test's image
// is in its cache, and loc (two 1×L40S machines) the scheduler's
// preference for a machine that holds the image.
func containerFleet() *fleet.Fleet {
	return &fleet.Fleet{
		MachineTypes: map[string]fleet.MachineType{
			"l4-4": {GPUModel: "L4", GPUCount: 4},
			"t4-2": {GPUModel: "T4", GPUCount: 2},
			"l40s": {GPUModel: "L40S", GPUCount: 1},
		},
		Pools: []fleet.Pool{
			{Name: "ctr", MachineType: "l4-4", Count: 1, Zone: "zone-a", PriceClass: "on-demand"},
			{Name: "gc", MachineType: "t4-2", Count: 1, Zone: "zone-a", PriceClass: "on-demand"},
			{Name: "loc", MachineType: "l40s", Count: 2, Zone: "zone-a", PriceClass: "on-demand"},
		},
	}
}

// lastInventory is node's latest inventory on NODES.
func lastInventory(t testing.TB, s *stack, node string) contracts.NodeInventory {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, contracts.StreamNodes)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(ctx, contracts.SubjectInventory(node))
	if err != nil {
		t.Fatalf("inventory of %s: %v", node, err)
	}
	var inv contracts.NodeInventory
	if err := json.Unmarshal(m.Data, &inv); err != nil {
		t.Fatal(err)
	}
	return inv
}

// TestContainerJobs runs container jobs through the whole platform: what a
// job sees inside (its devices, user, limits, mounts), isolation between
// two jobs on one machine, pulls (pulling events, a missing image, a
// refused login, a tenant's stored login), the cache's garbage collection
// under pressure, stop with grace and SIGUSR1 checkpoints in a container,
// a machine without runc, and an agent killed mid-run that re-adopts its
// container.
func TestContainerJobs(t *testing.T) {
	bb := requireContainers(t)
	pub := startRegistry(t, "", "")
	priv := startRegistry(t, "puller", "s3cret")
	img := busyboxImage(t, bb, map[string]string{"data/marker": "base\n"})
	base := pub.push(t, "e2e/busybox:v1", img)
	private := priv.push(t, "team/busybox:v1", busyboxImage(t, bb, map[string]string{"data/marker": "private\n"}))
	gcImgs := map[string]v1.Image{}
	gcRefs := map[string]string{}
	for _, n := range []string{"a", "b", "c"} {
		gcImgs[n] = busyboxImage(t, bb, map[string]string{"data/marker": "gc-" + n + "\n"})
		gcRefs[n] = pub.push(t, "e2e/gc-"+n+":v1", gcImgs[n])
	}
	fi, err := os.Stat(bb)
	if err != nil {
		t.Fatal(err)
	}
	// Room for one image, not two: a second pull puts the cache over its
	// limit, and only images no run holds may go.
	cacheLimit := fi.Size() + fi.Size()/2

	roots := t.TempDir()
	dataset, scratch, signals := filepath.Join(roots, "dataset"), filepath.Join(roots, "scratch"), filepath.Join(roots, "signals")
	for _, d := range []string{dataset, scratch, signals} {
		if err := os.MkdirAll(d, 0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, 0o777); err != nil { // the jobs run as nobody
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dataset, "train.txt"), []byte("tokens\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	s := startStack(t, containerFleet(), withNodeIdentities("ext-01", "norunc-01"), func(c *gpuplane.Config) {
		c.Agent = func(a *nodeagent.Config) { a.ImageCacheMaxBytes = cacheLimit; a.StopGrace = 5 * time.Second }
	})
	h := s.watchHistory(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	policy := contracts.PoolRuntime{AllowHostCommands: true, MountRoots: []string{roots}}
	setPoolRuntime(t, s, h, "ctr", policy, base)

	end := func(t *testing.T, id string) contracts.JobEvent {
		t.Helper()
		return h.await(t, 2*time.Minute, "acme/"+id, "its end", func(ev contracts.JobEvent) bool { return ev.State.Terminal() })
	}
	// logsOf is an ended job's whole output: followed to its end, since
	// the agent may report the end before it ships the last of it.
	logsOf := func(t *testing.T, id string) string {
		t.Helper()
		lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l := getLogs(lctx, s.ep.GatewayURL, id, "?follow=true")
		if l.err != nil || l.complete != "true" {
			t.Fatalf("logs of %s: complete %q, %v; so far %q", id, l.complete, l.err, l.body)
		}
		return l.body
	}
	succeeded := func(t *testing.T, id string) string {
		t.Helper()
		if ev := end(t, id); ev.Type != contracts.EventSucceeded {
			t.Fatalf("%s ended %s (%s: %s), want succeeded; events %s; output:\n%s", id, ev.Type, ev.Reason, ev.Message, h.types("acme/"+id), logsOf(t, id))
		}
		return logsOf(t, id)
	}

	t.Run("inside", func(t *testing.T) {
		req := containerJob("inside", "ctr", "L4", base, `
echo "user=$(id -u):$(id -g)"
echo "visible=$CUDA_VISIBLE_DEVICES nvidia=$NVIDIA_VISIBLE_DEVICES"
echo "nvidia-devices=$(ls /dev | grep -c nvidia)"
echo "pid1=$(cat /proc/1/comm)"
echo "net=$(ls /sys/class/net | tr '\n' ' ')"
echo "nnp=$(grep NoNewPrivs /proc/self/status | tr -d ' \t') seccomp=$(grep '^Seccomp:' /proc/self/status | tr -d ' \t')"
echo "memory-limit=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max)"
echo "cpu-quota=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null || cut -d' ' -f1 /sys/fs/cgroup/cpu.max)"
echo "dataset=$(cat /dataset/train.txt)"
if touch /dataset/x 2>/dev/null; then echo "dataset writable"; else echo "dataset read-only"; fi
echo "from $HOSTNAME" > /scratch/out && echo "scratch written"
echo "marker=$(cat /data/marker)"
if touch /data/marker 2>/dev/null; then echo "image file writable in this run's root"; fi
`)
		req.Resources.MemoryMiB = 256
		req.Resources.CPUMilli = 500
		req.Resources.GPU.Count = 2
		req.Run.Mounts = []contracts.Mount{{Source: dataset, Target: "/dataset", ReadOnly: true}, {Source: scratch, Target: "/scratch"}}
		s.submitJob(t, ctx, "acme", req)
		out := succeeded(t, "inside")
		var uuids []string
		for _, d := range placementOf(t, s, "inside").Devices {
			uuids = append(uuids, d.VisibleUUID())
		}
		all := strings.Join(uuids, ",")
		for _, want := range []string{
			"user=65534:65534", // the image's root became nobody
			"visible=" + all + " nvidia=" + all,
			"nvidia-devices=0",                   // simulated GPUs: no device nodes, and none of the host's
			"pid1=sh",                            // its own PID namespace
			"net=lo ",                            // its own network namespace: the pool gives no host network
			"nnp=NoNewPrivs:1 seccomp=Seccomp:2", // no new privileges, a seccomp filter
			"memory-limit=" + strconv.Itoa(256<<20),
			"cpu-quota=50000", // half of each 100 ms period
			"dataset=tokens", "dataset read-only", "scratch written", "marker=base",
		} {
			if !slices.Contains(strings.Split(out, "\n"), want) {
				t.Errorf("inside printed no line %q; output:\n%s", want, out)
			}
		}
		if len(uuids) != 2 {
			t.Errorf("inside ran on %v, want 2 GPUs", uuids)
		}
		if b, err := os.ReadFile(filepath.Join(scratch, "out")); err != nil || !strings.HasPrefix(string(b), "from ") {
			t.Errorf("the scratch mount's file on the host: %q %v", b, err)
		}
		if _, err := os.Stat(filepath.Join(dataset, "x")); err == nil {
			t.Error("the read-only dataset mount was written")
		}
		// The image was pulled by the pool policy's probe: a hit, no pull.
		if n := h.count("acme/inside", contracts.EventPulling); n != 0 {
			t.Errorf("%d pulling events for inside, whose image was cached; events %s", n, h.types("acme/inside"))
		}
	})

	t.Run("args, user, working directory, shm", func(t *testing.T) {
		// No command: args replace the image's CMD (sh), as Kubernetes
		// reads them; a user of the image by name; /dev/shm of its size.
		req := containerJob("argv", "ctr", "L4", base, "")
		req.Run.Command = nil
		req.Run.Args = []string{"sh", "-c", `echo "$(id -un) in $(pwd), shm $(df -k /dev/shm | tail -1 | tr -s ' ' | cut -d' ' -f2) KiB"`}
		req.Run.User, req.Run.WorkingDir, req.Run.ShmSizeMiB = "app", "/work", 32
		s.submitJob(t, ctx, "acme", req)
		if out := succeeded(t, "argv"); out != "app in /work, shm 32768 KiB\n" {
			t.Errorf("argv printed %q", out)
		}
	})

	t.Run("isolation", func(t *testing.T) {
		// One job holds a process and a file; the other, on the same
		// machine, must see neither.
		s.submitJob(t, ctx, "acme", withSignals(containerJob("holder", "ctr", "L4", base, `
echo secret > /tmp/holder-file; sleep 31337 & echo "holding $!"
i=0; while [ ! -e /signals/holder-go ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
kill %1; echo done`), signals))
		h.awaitState(t, time.Minute, "acme/holder", contracts.StateRunning)
		waitFor(t, 30*time.Second, "holder's sleep", func() (bool, string) {
			return strings.Contains(getLogs(ctx, s.ep.GatewayURL, "holder", "").body, "holding"), "no output yet"
		})
		s.submitJob(t, ctx, "acme", containerJob("peeker", "ctr", "L4", base, `
echo "processes=$(ls /proc | grep -c '^[0-9]')"
if ps | grep -v grep | grep -q 31337; then echo "sees holder's process"; fi
if [ -e /tmp/holder-file ]; then echo "sees holder's file"; fi
echo peeked`))
		out := succeeded(t, "peeker")
		if strings.Contains(out, "sees holder") || !strings.Contains(out, "peeked") {
			t.Errorf("peeker's output:\n%s", out)
		}
		// Its shell, a subshell, ls and grep: nothing of the machine's or
		// holder's (a machine has hundreds).
		var n int
		if _, err := fmt.Sscanf(out, "processes=%d", &n); err != nil || n > 5 {
			t.Errorf("peeker saw %d processes (%v); output:\n%s", n, err, out)
		}
		if err := os.WriteFile(filepath.Join(signals, "holder-go"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		succeeded(t, "holder")
	})

	t.Run("pull failures", func(t *testing.T) {
		missing := pub.host + "/e2e/no-such-image:v1"
		s.submitJob(t, ctx, "acme", containerJob("missing", "ctr", "L4", missing, "true"))
		s.submitJob(t, ctx, "acme", containerJob("no-login", "ctr", "L4", private, "true"))
		for id, want := range map[string]contracts.Reason{"missing": contracts.ReasonImageNotFound, "no-login": contracts.ReasonImageUnauthorized} {
			ev := end(t, id)
			if ev.Type != contracts.EventFailed || ev.Reason != want {
				t.Errorf("%s ended %s (%s: %s), want failed with %s; events %s", id, ev.Type, ev.Reason, ev.Message, want, h.types("acme/"+id))
			}
			if n := h.count("acme/"+id, contracts.EventRunning); n != 0 {
				t.Errorf("%s ran %d times", id, n)
			}
		}
		// A wrong password stored for the tenant is refused as well; the
		// right one pulls the private image.
		admin := connectClient(t, s.ep.NATSURL, s.ep.Creds["admin"], "e2e-registry-admin")
		kv, err := admin.js.KeyValue(ctx, contracts.BucketRegistryCredentials)
		if err != nil {
			t.Fatal(err)
		}
		store := func(password string) {
			b, _ := json.Marshal(contracts.RegistryCredentials{SchemaVersion: contracts.SchemaVersion, Tenant: "acme",
				Registries: map[string]contracts.RegistryAuth{priv.host: {Username: "puller", Password: password}}})
			if _, err := kv.Put(ctx, "acme", b); err != nil {
				t.Fatal(err)
			}
		}
		store("wrong")
		s.submitJob(t, ctx, "acme", containerJob("bad-login", "ctr", "L4", private, "true"))
		if ev := end(t, "bad-login"); ev.Type != contracts.EventFailed || ev.Reason != contracts.ReasonImageUnauthorized {
			t.Errorf("bad-login ended %s (%s: %s), want failed with image_unauthorized", ev.Type, ev.Reason, ev.Message)
		}
		if ev, _ := h.last("acme/bad-login"); strings.Contains(ev.Message, "wrong") {
			t.Errorf("the failure shows the password: %q", ev.Message)
		}
		store("s3cret")
		s.submitJob(t, ctx, "acme", containerJob("good-login", "ctr", "L4", private, "cat /data/marker"))
		if out := succeeded(t, "good-login"); out != "private\n" {
			t.Errorf("good-login printed %q, want the private image's marker", out)
		}
		// Its first pull of the image showed as pulling events, up to
		// the whole image, before it ran.
		var whole bool
		for _, ev := range h.of("acme/good-login") {
			if ev.Type == contracts.EventRunning {
				break
			}
			if ev.Type == contracts.EventPulling {
				if ev.Pull == nil || ev.Pull.Image != private {
					t.Errorf("pulling event %+v, want its image %s", ev.Pull, private)
					continue
				}
				whole = whole || (ev.Pull.Total > 0 && ev.Pull.Done == ev.Pull.Total)
			}
		}
		if !whole {
			t.Errorf("good-login's events before running show no whole pull: %s", h.types("acme/good-login"))
		}
		// The private image is in ctr-01's cache now; another tenant with
		// no login of its own must not run it from there.
		other := containerJob("borrower", "ctr", "L4", private, "cat /data/marker")
		s.submitJob(t, ctx, "globex", other)
		ev := h.await(t, 2*time.Minute, "globex/borrower", "its end", func(ev contracts.JobEvent) bool { return ev.State.Terminal() })
		if ev.Type != contracts.EventFailed || ev.Reason != contracts.ReasonImageUnauthorized {
			t.Errorf("globex's run of acme's cached private image ended %s (%s: %s), want failed with image_unauthorized; events %s",
				ev.Type, ev.Reason, ev.Message, h.types("globex/borrower"))
		}
	})

	t.Run("cancel while pulling", func(t *testing.T) {
		// A registry that holds its blobs back until the test lets them go:
		// the job is cancelled while its image is being pulled, and must
		// never start; a later job of the image is not hurt by it.
		slowImg := busyboxImage(t, bb, map[string]string{"data/marker": "slow\n"})
		layers, err := slowImg.Layers()
		if err != nil {
			t.Fatal(err)
		}
		held := map[string]bool{}
		for _, l := range layers {
			d, err := l.Digest()
			if err != nil {
				t.Fatal(err)
			}
			held[d.String()] = true
		}
		release := make(chan struct{})
		var once sync.Once
		inner := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && held[path.Base(r.URL.Path)] {
				<-release
			}
			inner.ServeHTTP(w, r)
		}))
		t.Cleanup(srv.Close)
		// Before srv.Close, which waits for the requests held here.
		t.Cleanup(func() { once.Do(func() { close(release) }) })
		slowReg := &testRegistry{host: strings.TrimPrefix(srv.URL, "http://")}
		slow := slowReg.push(t, "e2e/slow:v1", slowImg)
		s.submitJob(t, ctx, "acme", containerJob("pull-cancelled", "ctr", "L4", slow, "echo ran"))
		h.await(t, time.Minute, "acme/pull-cancelled", "pulling", isType(contracts.EventPulling, 1))
		if code, b := s.callAPI(t, http.MethodDelete, "/v1/tenants/acme/jobs/pull-cancelled", nil, nil); code != http.StatusAccepted {
			t.Fatalf("cancel: %d %s", code, b)
		}
		if ev := end(t, "pull-cancelled"); ev.Type != contracts.EventCancelled {
			t.Errorf("pull-cancelled ended %s (%s: %s), want cancelled", ev.Type, ev.Reason, ev.Message)
		}
		once.Do(func() { close(release) })
		s.submitJob(t, ctx, "acme", containerJob("pull-after", "ctr", "L4", slow, "cat /data/marker"))
		if out := succeeded(t, "pull-after"); out != "slow\n" {
			t.Errorf("pull-after printed %q", out)
		}
		if n := h.count("acme/pull-cancelled", contracts.EventRunning); n != 0 {
			t.Errorf("pull-cancelled ran; events %s", h.types("acme/pull-cancelled"))
		}
		if started := runFacts(t, ctx, s, contracts.AllocationID("acme", "pull-cancelled", 1))[contracts.RunStarted]; len(started) != 0 {
			t.Errorf("pull-cancelled has %d started facts, want none", len(started))
		}
	})

	t.Run("stop with grace", func(t *testing.T) {
		s.submitJob(t, ctx, "acme", containerJob("graceful", "ctr", "L4", base, `
trap 'echo "got TERM"; exit 0' TERM
echo ready; while :; do sleep 0.1; done`))
		waitFor(t, time.Minute, "graceful ready", func() (bool, string) {
			return strings.Contains(getLogs(ctx, s.ep.GatewayURL, "graceful", "").body, "ready"), "no output yet"
		})
		if code, b := s.callAPI(t, http.MethodDelete, "/v1/tenants/acme/jobs/graceful", nil, nil); code != http.StatusAccepted {
			t.Fatalf("cancel: %d %s", code, b)
		}
		if ev := end(t, "graceful"); ev.Type != contracts.EventCancelled {
			t.Errorf("graceful ended %s, want cancelled", ev.Type)
		}
		waitFor(t, 30*time.Second, "graceful's last words", func() (bool, string) {
			out := getLogs(ctx, s.ep.GatewayURL, "graceful", "").body
			return strings.Contains(out, "got TERM"), out
		})
		// Its time limit stops a container the same way.
		limited := containerJob("limited", "ctr", "L4", base, `
trap 'echo "got TERM"; exit 0' TERM
echo ready; while :; do sleep 0.1; done`)
		limited.Run.Duration = contracts.Duration(time.Second)
		s.submitJob(t, ctx, "acme", limited)
		if ev := end(t, "limited"); ev.Type != contracts.EventFailed || !strings.Contains(ev.Message, "time limit") {
			t.Errorf("limited ended %s (%s: %s), want failed at its time limit", ev.Type, ev.Reason, ev.Message)
		}
		if out := logsOf(t, "limited"); out != "ready\ngot TERM\n" {
			t.Errorf("limited printed %q, want its trap's words after the limit's SIGTERM", out)
		}
	})

	t.Run("checkpoint", func(t *testing.T) {
		req := containerJob("ckpt", "ctr", "L4", base, `n=0
trap 'n=$((n+1)); d="$GPUPLANE_CHECKPOINT_DIR/step-$n"; mkdir -p "$d"; echo "$n" > "$d/state";
      echo "step-$n" > "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp"; mv "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp" "$GPUPLANE_CHECKPOINT_DIR/LATEST"; echo "checkpointed $n"' USR1
echo ready
i=0; while [ $i -lt 1200 ] && [ $n -lt 1 ]; do sleep 0.1; i=$((i+1)); done
echo "done after $n checkpoints"`)
		req.Run.Checkpoint = true
		s.submitJob(t, ctx, "acme", req)
		waitFor(t, time.Minute, "ckpt ready", func() (bool, string) {
			return strings.Contains(getLogs(ctx, s.ep.GatewayURL, "ckpt", "").body, "ready"), "no output yet"
		})
		if code, b := s.callAPI(t, http.MethodPost, "/v1/tenants/acme/jobs/ckpt/checkpoint", nil, nil); code != http.StatusAccepted {
			t.Fatalf("checkpoint: %d %s", code, b)
		}
		if out := succeeded(t, "ckpt"); out != "ready\ncheckpointed 1\ndone after 1 checkpoints\n" {
			t.Errorf("ckpt's output %q", out)
		}
		facts := runFacts(t, ctx, s, contracts.AllocationID("acme", "ckpt", 1))
		if c := facts[contracts.RunCheckpointed]; len(c) != 1 || c[0].Checkpoint == nil || c[0].Checkpoint.Name != "step-1" || !c[0].Checkpoint.Requested {
			t.Errorf("checkpointed facts %+v, want one requested step-1", c)
		}
	})

	t.Run("migration restores a checkpoint", func(t *testing.T) {
		// An XID on its GPU moves a checkpointable container job: the
		// agent asks it for a checkpoint (SIGUSR1), stops it, and the next
		// attempt, in a new container, finds it through
		// GPUPLANE_RESTORE_FROM, a path inside the container.
		req := containerJob("moved", "ctr", "L4", base, `
if [ -n "$GPUPLANE_RESTORE_FROM" ]; then echo "restored $(cat "$GPUPLANE_RESTORE_FROM/state") at $GPUPLANE_RESTORE_FROM"; exit 0; fi
trap 'd="$GPUPLANE_CHECKPOINT_DIR/step-1"; mkdir -p "$d"; echo from-attempt-1 > "$d/state";
      echo step-1 > "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp"; mv "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp" "$GPUPLANE_CHECKPOINT_DIR/LATEST"; echo checkpointed' USR1
trap 'exit 143' TERM
echo ready; i=0; while [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done`)
		// The shell is the container's PID 1, which the kernel shields
		// from signals it has no handler for: without its TERM trap the
		// stop after the checkpoint would wait out the whole grace, as
		// docker stop does for such a container.
		req.Run.Checkpoint = true
		s.submitJob(t, ctx, "acme", req)
		waitFor(t, time.Minute, "moved ready", func() (bool, string) {
			return strings.Contains(getLogs(ctx, s.ep.GatewayURL, "moved", "").body, "ready"), "no output yet"
		})
		gpu := placementOf(t, s, "moved").Devices[0].Index
		if code, b := s.callAPI(t, http.MethodPost, "/v1/nodes/ctr-01/faults", map[string]string{"kind": string(contracts.FaultXID), "gpu": strconv.Itoa(gpu)}, nil); code != http.StatusAccepted {
			t.Fatalf("fault: %d %s", code, b)
		}
		ev := end(t, "moved")
		if ev.Type != contracts.EventSucceeded || ev.Attempt != 2 {
			t.Fatalf("moved ended %s at attempt %d (%s: %s), want succeeded at attempt 2; events %s", ev.Type, ev.Attempt, ev.Reason, ev.Message, h.types("acme/moved"))
		}
		var second string
		waitFor(t, 30*time.Second, "moved's second attempt's output", func() (bool, string) {
			out, eof := s.runOutput(t, "acme", "moved")
			id := contracts.AllocationID("acme", "moved", 2)
			second = out[id]
			return eof[id], second
		})
		if want := "restored from-attempt-1 at /gpuplane/checkpoint/step-1\n"; second != want {
			t.Errorf("moved's second attempt printed %q, want %q", second, want)
		}
	})

	t.Run("cache under pressure", func(t *testing.T) {
		setPoolRuntime(t, s, h, "gc", policy, gcRefs["a"])
		// The probe pulled a; it ended, so a is unheld. Hold it now.
		s.submitJob(t, ctx, "acme", withSignals(containerJob("gc-a", "gc", "T4", gcRefs["a"], `
i=0; while [ ! -e /signals/gc-go ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
cat /data/marker`), signals))
		h.awaitState(t, time.Minute, "acme/gc-a", contracts.StateRunning)
		s.submitJob(t, ctx, "acme", containerJob("gc-b", "gc", "T4", gcRefs["b"], "cat /data/marker"))
		if out := succeeded(t, "gc-b"); out != "gc-b\n" {
			t.Errorf("gc-b printed %q", out)
		}
		s.submitJob(t, ctx, "acme", containerJob("gc-c", "gc", "T4", gcRefs["c"], "cat /data/marker"))
		if out := succeeded(t, "gc-c"); out != "gc-c\n" {
			t.Errorf("gc-c printed %q", out)
		}
		// b and c each put the cache over its limit: once their runs let
		// go of them they were collected, while a, held by a running job
		// all along, stayed.
		da, db, dc := digestOf(t, gcImgs["a"]), digestOf(t, gcImgs["b"]), digestOf(t, gcImgs["c"])
		waitFor(t, 30*time.Second, "gc-01's inventory to list a only", func() (bool, string) {
			imgs := lastInventory(t, s, "gc-01").Images
			return slices.Contains(imgs, da) && !slices.Contains(imgs, dc) && !slices.Contains(imgs, db), fmt.Sprint(imgs)
		})
		if err := os.WriteFile(filepath.Join(signals, "gc-go"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if out := succeeded(t, "gc-a"); out != "gc-a\n" {
			t.Errorf("gc-a, whose image was held through the pressure, printed %q", out)
		}
	})

	t.Run("locality", func(t *testing.T) {
		// Of two empty machines of equal rank the scheduler takes the
		// first in node order (loc-01), unless the other holds the image.
		x := pub.push(t, "e2e/loc-x:v1", busyboxImage(t, bb, map[string]string{"data/marker": "loc-x\n"}))
		y := pub.push(t, "e2e/loc-y:v1", busyboxImage(t, bb, map[string]string{"data/marker": "loc-y\n"}))
		if code, b := s.callAPI(t, http.MethodPut, "/v1/pools/loc", contracts.PoolConfig{Pool: "loc", Policy: contracts.PolicyBinpack,
			Runtime: &contracts.PoolRuntime{AllowHostCommands: true}}, nil); code/100 != 2 {
			t.Fatalf("PUT /v1/pools/loc: %d %s", code, b)
		}
		nodeOf := func(id string) string {
			t.Helper()
			ev := h.await(t, time.Minute, "acme/"+id, "scheduled", isType(contracts.EventScheduled, 1))
			if ev.Placement == nil {
				t.Fatalf("%s scheduled with no placement", id)
			}
			return ev.Placement.NodeID
		}
		// A host command keeps loc-01 busy while x runs on loc-02.
		s.submitJob(t, ctx, "acme", containerJob("loc-blocker", "loc", "L40S", "",
			"i=0; while [ ! -e "+filepath.Join(signals, "loc-go")+" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done"))
		if n := nodeOf("loc-blocker"); n != "loc-01" {
			t.Fatalf("the first of two empty machines is %s, want loc-01 (node order)", n)
		}
		s.submitJob(t, ctx, "acme", containerJob("loc-x1", "loc", "L40S", x, "cat /data/marker"))
		if n := nodeOf("loc-x1"); n != "loc-02" {
			t.Fatalf("loc-x1 ran on %s, want loc-02, the free one", n)
		}
		succeeded(t, "loc-x1")
		dx := digestOf(t, busyboxImage(t, bb, map[string]string{"data/marker": "loc-x\n"}))
		waitFor(t, 30*time.Second, "loc-02's inventory to list x", func() (bool, string) {
			imgs := lastInventory(t, s, "loc-02").Images
			return slices.Contains(imgs, dx), fmt.Sprint(imgs)
		})
		if err := os.WriteFile(filepath.Join(signals, "loc-go"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		succeeded(t, "loc-blocker")
		// Both empty now: x goes where it is cached, y (cached nowhere)
		// to the first in node order.
		s.submitJob(t, ctx, "acme", containerJob("loc-x2", "loc", "L40S", x, "cat /data/marker"))
		if n := nodeOf("loc-x2"); n != "loc-02" {
			t.Errorf("loc-x2 ran on %s, want loc-02, which holds its image", n)
		}
		succeeded(t, "loc-x2")
		s.submitJob(t, ctx, "acme", containerJob("loc-y", "loc", "L40S", y, "cat /data/marker"))
		if n := nodeOf("loc-y"); n != "loc-01" {
			t.Errorf("loc-y, whose image no machine holds, ran on %s, want loc-01 (node order)", n)
		}
		succeeded(t, "loc-y")
	})

	t.Run("no runc", func(t *testing.T) {
		// A machine without runc fails container runs with
		// runtime_unavailable (requeued a few times, then failed) and
		// still runs host commands.
		startAgent(t, s, "norunc-01", "-pool", "norunc", "-gpu-model", "V100-16GB", "-gpu-count", "1",
			"-runc", filepath.Join(t.TempDir(), "no-runc-here"))
		s.submitJob(t, ctx, "acme", containerJob("no-runtime", "norunc", "V100-16GB", base, "true"))
		if ev := end(t, "no-runtime"); ev.Type != contracts.EventFailed || ev.Reason != contracts.ReasonRuntimeUnavailable {
			t.Errorf("no-runtime ended %s (%s: %s), want failed with runtime_unavailable; events %s", ev.Type, ev.Reason, ev.Message, h.types("acme/no-runtime"))
		}
		host := containerJob("host-cmd", "norunc", "V100-16GB", "", "echo on the host")
		s.submitJob(t, ctx, "acme", host)
		if out := succeeded(t, "host-cmd"); out != "on the host\n" {
			t.Errorf("host-cmd printed %q", out)
		}
	})

	t.Run("agent killed mid-run", func(t *testing.T) {
		ext := startAgent(t, s, "ext-01", "-pool", "ext", "-gpu-model", "H100-80GB", "-gpu-count", "2")
		setPoolRuntime(t, s, h, "ext", policy, base)
		req := containerJob("adopted", "ext", "H100-80GB", base, `
echo started
i=0; while [ ! -e /signals/adopted-go ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
echo finished`)
		s.submitJob(t, ctx, "acme", withSignals(req, signals))
		waitFor(t, time.Minute, "adopted started", func() (bool, string) {
			return strings.Contains(getLogs(ctx, s.ep.GatewayURL, "adopted", "").body, "started"), "no output yet"
		})
		before := lastInventory(t, s, "ext-01").Incarnation
		ext.kill()
		ext.start()
		// The new agent is up (a new incarnation) while the container runs
		// on; it re-adopts it and reports its end, and nothing starts it
		// again.
		waitFor(t, time.Minute, "ext-01's agent back", func() (bool, string) {
			inv := lastInventory(t, s, "ext-01")
			return inv.Incarnation != before, "incarnation " + inv.Incarnation
		})
		if strings.Contains(getLogs(ctx, s.ep.GatewayURL, "adopted", "").body, "finished") {
			t.Fatal("adopted finished before the test let it")
		}
		if err := os.WriteFile(filepath.Join(signals, "adopted-go"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if out := succeeded(t, "adopted"); out != "started\nfinished\n" {
			t.Errorf("adopted printed %q, want its whole output once", out)
		}
		facts := runFacts(t, ctx, s, contracts.AllocationID("acme", "adopted", 1))
		if len(facts[contracts.RunStarted]) != 1 || len(facts[contracts.RunEnded]) != 1 {
			t.Errorf("adopted has %d started and %d ended facts, want one each", len(facts[contracts.RunStarted]), len(facts[contracts.RunEnded]))
		}
		if n := h.count("acme/adopted", contracts.EventRunning); n != 1 {
			t.Errorf("adopted ran %d times; events %s", n, h.types("acme/adopted"))
		}
	})
}
