package scale

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/libs/natsauth"
	"github.com/gpuplane/gpuplane/libs/natsserver"
)

// serverEnv makes the test binary a NATS server instead (see TestMain):
// the server runs in its own process, so its memory and CPU are measured
// apart from every service's, on the same server code `make run` embeds.
const serverEnv = "GPUPLANE_SCALE_SERVER_DIR"

func TestMain(m *testing.M) {
	if dir := os.Getenv(serverEnv); dir != "" {
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
		HTTPPort: -1, Trust: trust, Name: "scale"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	serveHeapProfiles(dir)
	fmt.Printf("%s http://%s\n", srv.URL(), srv.MonitorAddr())
	_, _ = io.Copy(io.Discard, os.Stdin)
	srv.Shutdown()
	return 0
}

// proc is one process of the benchmark: a service, a fleet-sim or the
// NATS server. Its stdout and stderr (slog lines and, with
// GODEBUG=gctrace=1, one line per GC) go to its log file, which the
// sampler reads as it grows.
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string

	mu     sync.Mutex
	offset int64
	// heapMB is the live heap after the last GC (gctrace's third figure).
	heapMB float64
	// onLine, when set, sees every new log line (the scheduler's cycles).
	onLine func(line string)
	// warnings counts the WARN and ERROR lines by message: trouble under
	// load (a feed that stalls, a publish that times out) is a finding.
	warnings map[string]int
}

// startProc starts bin with args and env (added to this process's), its
// output in dir/<name>.log, and stops it (SIGTERM, then SIGKILL after 20 s)
// when the benchmark ends.
func startProc(b *testing.B, dir, name, bin string, args, env []string) *proc {
	b.Helper()
	p := &proc{name: name, logPath: filepath.Join(dir, name+".log")}
	lf, err := os.Create(p.logPath)
	if err != nil {
		b.Fatal(err)
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = append(append(os.Environ(), "GODEBUG=gctrace=1"), env...)
	p.cmd.Stdout, p.cmd.Stderr = lf, lf
	if err := p.cmd.Start(); err != nil {
		b.Fatalf("start %s: %v", name, err)
	}
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done); _ = lf.Close() }()
	b.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
	})
	return p
}

// exited is whether the process is gone (a crash under load is a finding).
func (p *proc) exited() bool {
	return p.cmd.ProcessState != nil || p.cmd.Process.Signal(syscall.Signal(0)) != nil
}

// tail is the last n lines of the process's log.
func (p *proc) tail(n int) string {
	data, _ := os.ReadFile(p.logPath)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// scan reads the log lines written since the last scan: the live heap of
// the last GC, and each line for onLine.
func (p *proc) scan() {
	p.mu.Lock()
	defer p.mu.Unlock()
	f, err := os.Open(p.logPath)
	if err != nil {
		return
	}
	defer f.Close()
	if _, err := f.Seek(p.offset, io.SeekStart); err != nil {
		return
	}
	r := bufio.NewReaderSize(f, 1<<20)
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			// A partial last line is read again next time.
			return
		}
		p.offset += int64(len(line))
		if h, ok := gcLiveHeap(line); ok {
			p.heapMB = h
			continue
		}
		if strings.Contains(line, " level=WARN ") || strings.Contains(line, " level=ERROR ") {
			if p.warnings == nil {
				p.warnings = map[string]int{}
			}
			p.warnings[logMsg(line)]++
		}
		if p.onLine != nil {
			p.onLine(line)
		}
	}
}

// logMsg is the msg= value of a slog text line (quoted or not).
func logMsg(line string) string {
	_, rest, ok := strings.Cut(line, " msg=")
	if !ok {
		return strings.TrimSpace(line)
	}
	if strings.HasPrefix(rest, `"`) {
		if s, err := strconv.QuotedPrefix(rest); err == nil {
			if u, err := strconv.Unquote(s); err == nil {
				return u
			}
		}
	}
	msg, _, _ := strings.Cut(rest, " ")
	return strings.TrimSpace(msg)
}

// warningSummary is "N: msg ×n, ..." for the commonest few, or "".
func (p *proc) warningSummary() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.warnings) == 0 {
		return ""
	}
	msgs := make([]string, 0, len(p.warnings))
	total := 0
	for m, n := range p.warnings {
		msgs = append(msgs, m)
		total += n
	}
	slices.SortFunc(msgs, func(a, b string) int {
		if d := p.warnings[b] - p.warnings[a]; d != 0 {
			return d
		}
		return strings.Compare(a, b)
	})
	var parts []string
	for _, m := range msgs[:min(3, len(msgs))] {
		parts = append(parts, fmt.Sprintf("%q ×%d", m, p.warnings[m]))
	}
	return fmt.Sprintf("%d: %s", total, strings.Join(parts, ", "))
}

// gcLiveHeap reads the live heap after a GC from a gctrace line:
// "gc 12 @3.1s 2%: ..., 41->43->20 MB, 42 MB goal, ...": 20.
func gcLiveHeap(line string) (float64, bool) {
	if !strings.HasPrefix(line, "gc ") {
		return 0, false
	}
	before, _, ok := strings.Cut(line, " MB, ")
	if !ok {
		return 0, false
	}
	i := strings.LastIndexByte(before, '>')
	if i < 0 {
		return 0, false
	}
	v, err := strconv.ParseFloat(before[i+1:], 64)
	return v, err == nil
}

// rssMB is a process's resident memory from /proc/PID/status (VmRSS).
func rssMB(pid int) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

// cpuSeconds is a process's CPU time (user + system) from /proc/PID/stat.
func cpuSeconds(pid int) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+2:]))
	u, _ := strconv.ParseFloat(fields[14-3], 64)
	s, _ := strconv.ParseFloat(fields[15-3], 64)
	return (u + s) / 100 // USER_HZ
}

// natsProc is the NATS server process (this test binary in server mode).
type natsProc struct {
	url, monitor string
	pid          int
	trust        *natsauth.Trust
	credsDir     string
	proc         *proc
}

func startNATS(b *testing.B, dir string) *natsProc {
	b.Helper()
	trust, err := natsauth.New()
	if err != nil {
		b.Fatal(err)
	}
	if err := trust.Save(filepath.Join(dir, "trust")); err != nil {
		b.Fatal(err)
	}
	p := &proc{name: "nats-server", logPath: filepath.Join(dir, "nats-server.log")}
	lf, err := os.Create(p.logPath)
	if err != nil {
		b.Fatal(err)
	}
	p.cmd = exec.Command(os.Args[0], "-test.run=^$")
	p.cmd.Env = append(os.Environ(), serverEnv+"="+dir, "GODEBUG=gctrace=1")
	stdin, err := p.cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	p.cmd.Stderr = lf
	if err := p.cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = stdin.Close()
		done := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
		_ = lf.Close()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		b.Fatalf("NATS server process did not start: %v\n%s", err, p.tail(20))
	}
	url, monitor, ok := strings.Cut(strings.TrimSpace(line), " ")
	if !ok {
		b.Fatalf("NATS server process said %q", line)
	}
	return &natsProc{url: url, monitor: monitor, pid: p.cmd.Process.Pid, trust: trust,
		credsDir: filepath.Join(dir, "creds"), proc: p}
}

// jsz is the part of the server's /jsz the benchmark reports.
type jsz struct {
	Memory   uint64 `json:"memory"`
	Storage  uint64 `json:"storage"`
	Messages uint64 `json:"messages"`
	Bytes    uint64 `json:"bytes"`
}

func (n *natsProc) jsz() (jsz, error) {
	var j jsz
	resp, err := http.Get(n.monitor + "/jsz")
	if err != nil {
		return j, err
	}
	defer resp.Body.Close()
	return j, json.NewDecoder(resp.Body).Decode(&j)
}

// buildServices builds the service binaries into dir, without -race: the
// benchmark measures the platform, not the race detector.
func buildServices(b *testing.B, dir string) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-o", dir+"/",
		"./services/scheduler/cmd/scheduler",
		"./services/resource-manager/cmd/resource-manager",
		"./services/billing/cmd/billing",
		"./services/monitor/cmd/monitor",
		"./services/autoscaler/cmd/autoscaler",
		"./services/gateway/cmd/gateway",
		"./services/node-agent/cmd/fleet-sim")
	cmd.Dir = "../.." // the repository root, from e2e/scale
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build of the services: %v\n%s", err, out)
	}
	b.Logf("built the services in %.1fs", time.Since(start).Seconds())
}

// freeAddr is a loopback address free now.
func freeAddr(b *testing.B) string {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
