package fleet_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/sim"
)

// benchServerEnv makes the test binary a NATS server instead (see
// TestMain): the benchmark runs the server in its own process, so the
// fleet's CPU and the server's are measured apart, on the same server code
// `make run` embeds.
const benchServerEnv = "GPUPLANE_FLEET_BENCH_SERVER_DIR"

func TestMain(m *testing.M) {
	// A run with a command is supervised by a copy of this binary.
	nodeagent.MaybeRunShim()
	if dir := os.Getenv(benchServerEnv); dir != "" {
		os.Exit(serveNATS(dir))
	}
	os.Exit(m.Run())
}

// serveNATS runs an embedded JetStream server storing in dir/store, with
// the trust saved in dir/trust (authentication on, as everywhere), prints
// its client and monitoring URLs on one line, and stops when stdin closes.
func serveNATS(dir string) int {
	trust, err := natsauth.Load(filepath.Join(dir, "trust"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	srv, err := natsserver.Start(context.Background(), natsserver.Options{StoreDir: filepath.Join(dir, "store"),
		HTTPPort: -1, Trust: trust})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Printf("%s http://%s\n", srv.URL(), srv.MonitorAddr())
	_, _ = io.Copy(io.Discard, os.Stdin)
	srv.Shutdown()
	return 0
}

// BenchmarkFleet runs the simulated fleet of deploy/fleet/large.yaml
// (scaled to each size of the sweep) against a NATS server in its own
// process and measures a steady-state window: the telemetry and
// heartbeats stored per second against what the fleet should send, every
// message the server received per second, the CPU of the fleet process and
// of the server (100 = one core), memory, and the latency of a publish
// made beside the fleet. Every other machine (MIG machines excepted) runs
// a whole-machine allocation, committed through the ledger as the resource
// manager does, so busy GPUs and the consumer path are part of the load;
// startup_s is the time until every machine's inventory is stored and
// runs_started_s the time until every run has started. A raw
// JetStream publish rate of telemetry-sized messages, measured in the same
// run once the fleet has stopped, is the baseline.
//
// GPUPLANE_FLEET_BENCH_MACHINES (default "500,2000") and
// GPUPLANE_FLEET_BENCH_WINDOW (default 20s) change the sweep,
// GPUPLANE_FLEET_BENCH_FLEET=FILE the fleet description;
// GPUPLANE_FLEET_BENCH_CPUPROFILE=FILE profiles the fleet process during
// the window.
func BenchmarkFleet(b *testing.B) {
	if runtime.GOOS != "linux" {
		b.Skip("reads process CPU from /proc: Linux only")
	}
	sizes := []int{500, 2000}
	if s := os.Getenv("GPUPLANE_FLEET_BENCH_MACHINES"); s != "" {
		sizes = nil
		for f := range strings.SplitSeq(s, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 2 {
				b.Fatalf("GPUPLANE_FLEET_BENCH_MACHINES: %q is not a machine count >= 2", f)
			}
			sizes = append(sizes, n)
		}
	}
	window := 20 * time.Second
	if s := os.Getenv("GPUPLANE_FLEET_BENCH_WINDOW"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d < time.Second {
			b.Fatalf("GPUPLANE_FLEET_BENCH_WINDOW: %q is not a duration of at least 1s", s)
		}
		window = d
	}
	for _, n := range sizes {
		b.Run(fmt.Sprintf("machines=%d", n), func(b *testing.B) {
			for range b.N {
				benchFleet(b, n, window)
			}
		})
	}
}

// benchFleetShape is deploy/fleet/large.yaml (2,000 machines of 8 GPUs),
// or the file GPUPLANE_FLEET_BENCH_FLEET names, with every pool scaled to
// make n machines in all.
func benchFleetShape(b *testing.B, n int) fleet.Fleet {
	path := os.Getenv("GPUPLANE_FLEET_BENCH_FLEET")
	if path == "" {
		path = filepath.Join("..", "..", "..", "deploy", "fleet", "large.yaml")
	}
	f, err := fleet.Load(path)
	if err != nil {
		b.Skipf("no fleet description here (module built alone?): %v", err)
	}
	total := 0
	for _, p := range f.Pools {
		total += p.Count
	}
	left := n
	for i := range f.Pools {
		f.Pools[i].Count = f.Pools[i].Count * n / total
		left -= f.Pools[i].Count
	}
	f.Pools[0].Count += left
	return f
}

func benchFleet(b *testing.B, n int, window time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := startBenchServer(b)
	warns := &warnCounter{}
	log := slog.New(warns)
	// Each party connects as itself: the fleet with the fleet's
	// permissions, the probe (which provisions the streams) as the
	// operator, the commits as the resource manager.
	connect := func(name string, id contracts.Identity) *bus.Bus {
		creds, err := srv.trust.WriteCreds(srv.credsDir, id)
		if err != nil {
			b.Fatal(err)
		}
		bb, err := bus.Connect(ctx, bus.Config{URL: srv.url, Name: name, Logger: log, CredsFile: creds})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = bb.Close(context.Background()) })
		return bb
	}
	probe := connect("fleet-bench", contracts.Identity{Name: "operator", Role: contracts.BusOperator})
	fb := connect("node-agent-fleet", contracts.Identity{Name: "fleet", Role: contracts.BusFleet})
	rm := connect("resource-manager", contracts.Identity{Name: "resource-manager", Role: contracts.BusResourceManager})
	js := probe.JetStream()

	f := benchFleetShape(b, n)
	machines := f.Machines()
	gpus := 0
	for _, m := range machines {
		gpus += m.GPUCount
	}
	runCtx, stopFleet := context.WithCancel(ctx)
	fleetDone := make(chan struct{})
	var fleetErr error
	start := time.Now()
	go func() {
		defer close(fleetDone)
		fleetErr = fleet.Run(runCtx, f, fb, nodeagent.Config{LogDir: b.TempDir()}, log)
	}()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		stopFleet()
		select {
		case <-fleetDone:
			if fleetErr != nil {
				b.Errorf("fleet.Run: %v", fleetErr)
			}
		case <-time.After(time.Minute):
			b.Error("fleet did not stop within a minute")
		}
	}
	defer stop()
	running := func() {
		select {
		case <-fleetDone:
			b.Fatalf("the fleet stopped: %v", fleetErr)
		default:
		}
	}

	// Started: every machine's inventory is stored (it goes out after the
	// agent has rebuilt its state, just before its loops start).
	waitFor(b, ctx, 5*time.Minute, fmt.Sprintf("%d inventories", n), func() (uint64, bool) {
		running()
		// A JetStream API too busy to answer is part of what is measured:
		// ask again.
		info, err := streamInfo(ctx, js, contracts.StreamNodes, jetstream.WithSubjectFilter(contracts.SubjectInventoryAll))
		if err != nil {
			return 0, false
		}
		c := uint64(len(info.State.Subjects))
		return c, c >= uint64(n)
	})
	startup := time.Since(start)

	// Every other machine gets a whole-machine run for the rest of the
	// benchmark (MIG machines stay idle: their GPUs are allocated by
	// instance).
	busy := machines[:0:0]
	for i, m := range machines {
		if i%2 == 0 && !m.MIGEnabled {
			busy = append(busy, m)
		}
	}
	commitStart := time.Now()
	commitAll(b, ctx, rm, busy)
	waitFor(b, ctx, 5*time.Minute, fmt.Sprintf("%d started runs", len(busy)), func() (uint64, bool) {
		running()
		info, err := streamInfo(ctx, js, contracts.StreamRuns)
		if err != nil {
			return 0, false
		}
		return info.State.LastSeq, info.State.LastSeq >= uint64(len(busy))
	})
	runsStarted := time.Since(commitStart)

	time.Sleep(2 * time.Second) // let the commit burst settle
	stopProfile := profileWindow(b)
	before := snapshot(ctx, b, js, srv)
	lat, probes := probePublish(ctx, probe, window)
	after := snapshot(ctx, b, js, srv)
	stopProfile()
	secs := after.at.Sub(before.at).Seconds()
	rate := func(now, then uint64) float64 { return float64(now-then) / secs }

	telemetry := rate(after.seqs[contracts.StreamTelemetry], before.seqs[contracts.StreamTelemetry]) - float64(probes)/secs
	var stored float64
	for s := range after.seqs {
		stored += rate(after.seqs[s], before.seqs[s])
	}
	started := startedRuns(ctx, b, probe)
	stop()
	raw, rawErrs := rawPublishRate(ctx, b, js, 3*time.Second)

	slices.Sort(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) / 1000
	}
	b.ReportMetric(float64(n), "machines")
	b.ReportMetric(float64(gpus), "gpus")
	b.ReportMetric(float64(started), "busy_machines")
	b.ReportMetric(startup.Seconds(), "startup_s")
	b.ReportMetric(runsStarted.Seconds(), "runs_started_s")
	b.ReportMetric(telemetry, "telemetry_msgs/s")
	b.ReportMetric(100*telemetry/float64(n), "telemetry_%_of_expected")
	b.ReportMetric(rate(after.seqs[contracts.StreamHeartbeats], before.seqs[contracts.StreamHeartbeats]), "heartbeats/s")
	b.ReportMetric(stored, "stored_msgs/s")
	b.ReportMetric(rate(after.varz.InMsgs, before.varz.InMsgs), "bus_in_msgs/s")
	b.ReportMetric(rate(after.varz.OutMsgs, before.varz.OutMsgs), "bus_out_msgs/s")
	b.ReportMetric(100*(after.selfCPU-before.selfCPU).Seconds()/secs, "fleet_cpu_%")
	b.ReportMetric(100*(after.serverCPU-before.serverCPU).Seconds()/secs, "server_cpu_%")
	b.ReportMetric(float64(after.alloc-before.alloc)/secs/(1<<20), "alloc_MB/s")
	b.ReportMetric(float64(after.rss)/(1<<20), "fleet_rss_MB")
	b.ReportMetric(float64(after.serverRSS)/(1<<20), "server_rss_MB")
	b.ReportMetric(float64(after.varz.Consumers), "server_consumers")
	b.ReportMetric(pct(0.5), "publish_p50_ms")
	b.ReportMetric(pct(0.99), "publish_p99_ms")
	b.ReportMetric(raw, "raw_js_msgs/s")
	b.ReportMetric(float64(warns.n.Load()), "warnings")
	if w := warns.first(); len(w) > 0 {
		b.Logf("%d warnings, first: %s", warns.n.Load(), strings.Join(w, " | "))
	}
	if rawErrs > 0 {
		b.Logf("raw publish baseline: %d publishes failed", rawErrs)
	}
	// The figures mean something only if the fleet really worked.
	if telemetry <= 0 {
		b.Fatalf("no telemetry stored in the window")
	}
	if started != len(busy) {
		b.Fatalf("%d of %d runs started", started, len(busy))
	}
}

// profileWindow writes a CPU profile of the steady-state window to the
// file GPUPLANE_FLEET_BENCH_CPUPROFILE names, if set (-test.cpuprofile
// would also take in the start and the baseline).
func profileWindow(b *testing.B) (stop func()) {
	path := os.Getenv("GPUPLANE_FLEET_BENCH_CPUPROFILE")
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		b.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			b.Error(err)
		}
	}
}

// benchServer is a NATS server process started by startBenchServer.
type benchServer struct {
	url, monitor string
	pid          int
	// trust mints the credentials of each party, into credsDir.
	trust    *natsauth.Trust
	credsDir string
}

func startBenchServer(b *testing.B) benchServer {
	b.Helper()
	dir := b.TempDir()
	trust, err := natsauth.New()
	if err != nil {
		b.Fatal(err)
	}
	if err := trust.Save(filepath.Join(dir, "trust")); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), benchServerEnv+"="+dir)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		b.Fatalf("NATS server process did not start: %v", err)
	}
	url, monitor, ok := strings.Cut(strings.TrimSpace(line), " ")
	if !ok {
		b.Fatalf("NATS server process said %q", line)
	}
	return benchServer{url: url, monitor: monitor, pid: cmd.Process.Pid, trust: trust, credsDir: filepath.Join(dir, "creds")}
}

// varz is the part of the server's /varz the benchmark reads.
type varz struct {
	InMsgs    uint64 `json:"in_msgs"`
	OutMsgs   uint64 `json:"out_msgs"`
	Consumers uint64 `json:"consumers"` // from /jsz
}

type benchSnapshot struct {
	at                 time.Time
	seqs               map[string]uint64
	varz               varz
	selfCPU, serverCPU time.Duration
	alloc              uint64
	rss, serverRSS     uint64
}

func snapshot(ctx context.Context, b *testing.B, js jetstream.JetStream, srv benchServer) benchSnapshot {
	s := benchSnapshot{seqs: map[string]uint64{}}
	for _, sc := range contracts.Streams(contracts.StreamOptions{}) {
		s.seqs[sc.Name] = lastSeq(ctx, b, js, sc.Name)
	}
	for _, page := range []string{"/varz", "/jsz"} {
		resp, err := http.Get(srv.monitor + page)
		if err != nil {
			b.Fatal(err)
		}
		err = json.NewDecoder(resp.Body).Decode(&s.varz)
		_ = resp.Body.Close()
		if err != nil {
			b.Fatalf("%s: %v", page, err)
		}
	}
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	s.selfCPU = time.Duration(syscall.TimevalToNsec(ru.Utime) + syscall.TimevalToNsec(ru.Stime))
	s.serverCPU, s.serverRSS = procStat(b, srv.pid)
	_, s.rss = procStat(b, os.Getpid())
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s.alloc = ms.TotalAlloc
	s.at = time.Now()
	return s
}

// procStat reads a process's CPU time (user + system) and resident memory
// from /proc/PID/stat.
func procStat(b *testing.B, pid int) (time.Duration, uint64) {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name, which is in parentheses and may hold
	// spaces: state is field 3, utime 14, stime 15, rss (pages) 24.
	fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+2:]))
	num := func(i int) uint64 {
		v, err := strconv.ParseUint(fields[i-3], 10, 64)
		if err != nil {
			b.Fatalf("/proc/%d/stat field %d: %v", pid, i, err)
		}
		return v
	}
	const ticks = 100 // USER_HZ, 100 on every Linux platform Go supports
	cpu := time.Duration(num(14)+num(15)) * time.Second / ticks
	return cpu, num(24) * uint64(os.Getpagesize())
}

func lastSeq(ctx context.Context, b *testing.B, js jetstream.JetStream, stream string) uint64 {
	info, err := streamInfo(ctx, js, stream)
	if err != nil {
		b.Fatal(err)
	}
	return info.State.LastSeq
}

func streamInfo(ctx context.Context, js jetstream.JetStream, stream string, opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	return info, nil
}

// waitFor polls until done says so, failing the benchmark after limit.
func waitFor(b *testing.B, ctx context.Context, limit time.Duration, what string, done func() (uint64, bool)) {
	b.Helper()
	deadline := time.Now().Add(limit)
	for {
		got, ok := done()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("waited %s for %s; have %d", limit, what, got)
		}
		select {
		case <-ctx.Done():
			b.Fatal(ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// commitAll commits one 8-GPU simulated run of an hour on each machine,
// as the resource manager would.
func commitAll(b *testing.B, ctx context.Context, bb *bus.Bus, machines []fleet.Machine) {
	var wg sync.WaitGroup
	errs := make(chan error, len(machines))
	sem := make(chan struct{}, 32)
	for _, m := range machines {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			job := "bench-" + m.NodeID
			a := contracts.Allocation{ID: contracts.AllocationID("bench", job, 1), Tenant: "bench", JobID: job, Attempt: 1,
				NodeID: m.NodeID, Pool: m.Pool, Run: contracts.RunSpec{Duration: contracts.Duration(time.Hour)}}
			for i := range m.GPUCount {
				a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: sim.UUID(m.NodeID, i), Model: m.GPUModel})
			}
			e := contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: contracts.LedgerCommitted, Allocation: a, Time: time.Now()}
			if _, err := bb.Publish(ctx, contracts.SubjectLedger(m.NodeID), contracts.LedgerEntryID(e.Kind, a.ID), e); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
}

// startedRuns counts the runs started and not ended.
func startedRuns(ctx context.Context, b *testing.B, bb *bus.Bus) int {
	running := map[string]bool{}
	_, err := bb.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamRuns}, func(_ context.Context, m *bus.Msg) error {
		var ev contracts.RunEvent
		if err := m.Decode(&ev); err != nil {
			return err
		}
		running[ev.AllocationID] = ev.Kind == contracts.RunStarted
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	n := 0
	for _, r := range running {
		if r {
			n++
		}
	}
	return n
}

// probePublish publishes a telemetry-sized batch for a node outside the
// fleet every 50 ms during window and returns each publish's latency.
func probePublish(ctx context.Context, bb *bus.Bus, window time.Duration) ([]time.Duration, int) {
	tel := contracts.Telemetry{SchemaVersion: contracts.SchemaVersion, NodeID: "zz-bench-probe", Pool: "probe"}
	for i := range 8 {
		tel.GPUs = append(tel.GPUs, contracts.GPUSample{Index: i, UUID: sim.UUID("zz-bench-probe", i), Model: "H100-80GB",
			GPUUtil: 93, MemCopyUtil: 41, FBUsedMiB: 60000, FBFreeMiB: 21559, TempC: 74, PowerW: 650.25, SMClockMHz: 1965,
			PowerLimitW: 700, Healthy: true, AllocationID: "bench-probe-allocation"})
	}
	var lat []time.Duration
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	end := time.Now().Add(window)
	for seq := 1; time.Now().Before(end); seq++ {
		<-t.C
		tel.Time = time.Now()
		start := time.Now()
		if _, err := bb.Publish(ctx, contracts.SubjectTelemetry(tel.NodeID), "probe/"+strconv.Itoa(seq), tel); err == nil {
			lat = append(lat, time.Since(start))
		}
	}
	return lat, len(lat)
}

// rawPublishRate publishes copies of the last stored telemetry batch with
// plain asynchronous JetStream publishes (a Nats-Msg-Id each, 256 in
// flight) for d and returns the acknowledged messages per second: what
// this server and client can store on this machine, the ceiling the
// fleet's rate is compared with.
func rawPublishRate(ctx context.Context, b *testing.B, js jetstream.JetStream, d time.Duration) (float64, int) {
	s, err := js.Stream(ctx, contracts.StreamTelemetry)
	if err != nil {
		b.Fatal(err)
	}
	last, err := s.GetLastMsgForSubject(ctx, contracts.SubjectTelemetryAll)
	if err != nil {
		b.Fatal(err)
	}
	var acked, failed int
	settle := func(fs []jetstream.PubAckFuture) {
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(10 * time.Second):
		}
		for _, f := range fs {
			select {
			case <-f.Ok():
				acked++
			default:
				failed++
			}
		}
	}
	start := time.Now()
	batch := make([]jetstream.PubAckFuture, 0, 256)
	for i := 0; time.Since(start) < d; i++ {
		m := nats.NewMsg(contracts.SubjectTelemetry("zz-bench-raw"))
		m.Data = last.Data
		m.Header = last.Header
		f, err := js.PublishMsgAsync(m, jetstream.WithMsgID("raw/"+strconv.Itoa(i)))
		if err != nil {
			failed++
			continue
		}
		if batch = append(batch, f); len(batch) == cap(batch) {
			settle(batch)
			batch = batch[:0]
		}
	}
	settle(batch)
	return float64(acked) / time.Since(start).Seconds(), failed
}

// warnCounter is a slog handler that counts records at Warn and above
// and keeps the first few.
type warnCounter struct {
	n     atomic.Int64
	mu    sync.Mutex
	lines []string
}

func (w *warnCounter) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (w *warnCounter) Handle(_ context.Context, r slog.Record) error {
	if w.n.Add(1) <= 5 {
		var sb strings.Builder
		sb.WriteString(r.Message)
		r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&sb, " %s=%v", a.Key, a.Value); return true })
		w.mu.Lock()
		w.lines = append(w.lines, sb.String())
		w.mu.Unlock()
	}
	return nil
}

func (w *warnCounter) WithAttrs([]slog.Attr) slog.Handler { return w }
func (w *warnCounter) WithGroup(string) slog.Handler      { return w }

func (w *warnCounter) first() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.lines)
}
