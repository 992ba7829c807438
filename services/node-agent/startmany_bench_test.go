package nodeagent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

// BenchmarkStartMany measures what the node agent's per-run work costs
// (issue 17): N simulated runs committed at once to one agent, from the
// first ledger entry published to the last fact seen on gp.runs.<node>.
// "started" runs are ten minutes long (commit → started fact, the
// scheduling hot path); "ended" runs last no time at all (the whole life
// of a run: started, log shipped, ended, its state forgotten). It reports
// runs/s, the CPU of the whole process per run (the agent, the embedded
// NATS server storing its facts and log chunks, and the benchmark's own
// publishing, which is the same before and after a change), and the files
// each run leaves in the agent's log directory.
//
//	go test -run '^$' -bench StartMany -benchtime 3x ./services/node-agent/
//	GPUPLANE_BENCH_RUNS=5000 go test ... (the default is 1,000 runs)
func BenchmarkStartMany(b *testing.B) {
	n := 1000
	if v, err := strconv.Atoi(os.Getenv("GPUPLANE_BENCH_RUNS")); err == nil && v > 0 {
		n = v
	}
	for _, c := range []struct {
		name     string
		duration time.Duration
		want     contracts.RunKind
	}{
		{"started", 10 * time.Minute, contracts.RunStarted},
		{"ended", 0, contracts.RunEnded},
	} {
		b.Run(c.name, func(b *testing.B) {
			srv := natstest.Start(b)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "bench", CredsFile: natstest.Operator(b, srv),
				Streams: contracts.StreamOptions{Memory: true}})
			if err != nil {
				b.Fatal(err)
			}
			defer op.Close(context.Background())
			rm, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "resource-manager", SkipProvision: true,
				CredsFile: natstest.Service(b, srv, contracts.BusResourceManager)})
			if err != nil {
				b.Fatal(err)
			}
			defer rm.Close(context.Background())
			var cpu, wall time.Duration
			var files int
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				node := fmt.Sprintf("bench-%d", i)
				dir := b.TempDir()
				stop := startBenchAgent(b, srv.URL(), natstest.Node(b, srv, node), node, dir)
				seen := countFacts(b, op.Conn(), node, c.want)
				b.StartTimer()
				t0, c0 := time.Now(), processCPU()
				commitMany(b, ctx, rm, node, n, c.duration)
				seen.wait(b, ctx, n)
				wall += time.Since(t0)
				cpu += processCPU() - c0
				b.StopTimer()
				files += countFiles(dir)
				seen.close()
				stop()
			}
			b.ReportMetric(float64(n*b.N)/wall.Seconds(), "runs/s")
			b.ReportMetric(float64(cpu.Microseconds())/float64(n*b.N), "cpu-µs/run")
			b.ReportMetric(float64(files)/float64(n*b.N), "files/run")
		})
	}
}

// startBenchAgent runs one agent in this process on a connection of its
// own until stop is called.
func startBenchAgent(b *testing.B, url, creds, node, dir string) (stop func()) {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ab, err := bus.Connect(ctx, bus.Config{URL: url, Name: nodeagent.ServiceName + "-" + node, CredsFile: creds, SkipProvision: true})
	if err != nil {
		b.Fatal(err)
	}
	cfg := nodeagent.Config{NodeID: node, Pool: "bench", GPUModel: "H100-80GB", GPUCount: 8, NVLink: true,
		HeartbeatInterval: time.Second, TelemetryInterval: time.Second, StopGrace: time.Second, LogDir: dir}
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	go func() { done <- nodeagent.RunWithBus(ctx, cfg, ab, log) }()
	return func() {
		cancel()
		if err := <-done; err != nil {
			b.Errorf("agent %s: %v", node, err)
		}
		_ = ab.Close(context.Background())
	}
}

// commitMany publishes n committed ledger entries of one-GPU simulated
// runs to node, asynchronously, as the resource manager would in a burst.
func commitMany(b *testing.B, ctx context.Context, rm *bus.Bus, node string, n int, d time.Duration) {
	b.Helper()
	js := rm.JetStream()
	for i := range n {
		a := allocation(node, fmt.Sprintf("job-%05d", i), contracts.RunSpec{Duration: contracts.Duration(d)}, i%8)
		e := contracts.LedgerEntry{SchemaVersion: contracts.SchemaVersion, Kind: contracts.LedgerCommitted, Allocation: a, Time: time.Now()}
		data, err := json.Marshal(e)
		if err != nil {
			b.Fatal(err)
		}
		// The headers bus.Publish sets that the agent looks at: the
		// resource manager's source above all.
		m := nats.NewMsg(contracts.SubjectLedger(node))
		m.Data = data
		m.Header.Set(contracts.HeaderCESpecVersion, contracts.CESpecVersion)
		m.Header.Set(contracts.HeaderCEType, e.CEType())
		m.Header.Set(contracts.HeaderCESource, "/gpuplane/"+rm.Name())
		m.Header.Set(contracts.HeaderCEID, contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID))
		m.Header.Set(contracts.HeaderContentType, contracts.ContentTypeJSON)
		m.Header.Set(contracts.HeaderMsgID, contracts.LedgerEntryID(contracts.LedgerCommitted, a.ID))
		if _, err := js.PublishMsgAsync(m); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		b.Fatal("ledger entries not acknowledged")
	}
}

// factCounter counts the facts of one kind on a node's runs subject, as
// the server stores them.
type factCounter struct {
	sub  *nats.Subscription
	n    atomic.Int64
	more chan struct{}
}

func countFacts(b *testing.B, nc *nats.Conn, node string, kind contracts.RunKind) *factCounter {
	b.Helper()
	want := "io.gpuplane.run." + string(kind) + ".v1"
	fc := &factCounter{more: make(chan struct{}, 1)}
	sub, err := nc.Subscribe(contracts.SubjectRuns(node), func(m *nats.Msg) {
		if m.Header.Get(contracts.HeaderCEType) == want {
			fc.n.Add(1)
			select {
			case fc.more <- struct{}{}:
			default:
			}
		}
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		b.Fatal(err)
	}
	fc.sub = sub
	return fc
}

func (fc *factCounter) wait(b *testing.B, ctx context.Context, n int) {
	b.Helper()
	for fc.n.Load() < int64(n) {
		select {
		case <-fc.more:
		case <-ctx.Done():
			b.Fatalf("%d of %d facts seen", fc.n.Load(), n)
		}
	}
}

func (fc *factCounter) close() { _ = fc.sub.Unsubscribe() }

// processCPU is the CPU time (user and system) this process used so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// countFiles counts the files (not directories) under dir.
func countFiles(dir string) int {
	n := 0
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			n++
		}
		return nil
	})
	return n
}
