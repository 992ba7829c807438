package e2e

import (
	"cmp"
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/gpuplane"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

// meteredStack is startStack on a server of the test's own (natstest, the
// same embedded server with R1 streams that startStack starts inside the
// platform), so that a benchmark can read the server's message counters:
// what the bus itself carried per job.
func meteredStack(b testing.TB, fl *fleet.Fleet, tune ...func(*gpuplane.Config)) (*stack, *busMeter) {
	b.Helper()
	srv := natstest.Start(b)
	s := startStack(b, fl, append([]func(*gpuplane.Config){func(cfg *gpuplane.Config) {
		cfg.NATS = &gpuplane.ExternalNATS{URL: srv.URL(), Trust: srv.Trust(), Replicas: 1}
	}}, tune...)...)
	return s, &busMeter{servers: []*natsserver.Server{srv}, js: s.js}
}

// busMeter reads what the bus carried: the servers' messages in and out
// (every publish, ack, pull request, delivery, reply and heartbeat) and,
// per stream, the messages stored.
type busMeter struct {
	servers []*natsserver.Server
	js      jetstream.JetStream
}

// busCounts is one reading of a busMeter.
type busCounts struct {
	at      time.Time
	in, out int64
	// stored is each stream's last sequence: the messages it ever stored.
	stored map[string]uint64
	// api is the JetStream API requests the account made (consumer and
	// stream management, direct gets, ...), not counting publishes.
	api uint64
	// cpu is the process's CPU time so far (processCPU).
	cpu time.Duration
	// delivered is each consumer's deliveries ("STREAM/consumer", an
	// ordered consumer's name cut at its random part, so that its
	// replacements add up).
	delivered map[string]uint64
}

func (m *busMeter) read(ctx context.Context, b testing.TB) busCounts {
	b.Helper()
	c := busCounts{at: time.Now(), cpu: processCPU(), stored: map[string]uint64{}, delivered: map[string]uint64{}}
	for _, s := range m.servers {
		v, err := s.Varz(nil)
		if err != nil {
			b.Fatal(err)
		}
		c.in += v.InMsgs
		c.out += v.OutMsgs
		jsz, err := s.Jsz(&server.JSzOptions{Accounts: true, Streams: true, Consumer: true})
		if err != nil {
			b.Fatal(err)
		}
		for _, a := range jsz.AccountDetails {
			for _, st := range a.Streams {
				for _, ci := range st.Consumer {
					c.delivered[st.Name+"/"+consumerKind(ci.Name)] += ci.Delivered.Consumer
				}
			}
		}
	}
	lister := m.js.ListStreams(ctx)
	for info := range lister.Info() {
		c.stored[info.Config.Name] = info.State.LastSeq
	}
	if err := lister.Err(); err != nil {
		b.Fatal(err)
	}
	if ai, err := m.js.AccountInfo(ctx); err == nil {
		c.api = ai.API.Total
	}
	return c
}

// busCost is what the bus carried per job between two readings, less the
// platform's background (heartbeats, telemetry, keep-alives) measured
// while idle just before, scaled to the same duration.
type busCost struct {
	jobs int
	// in and out are server messages per job; stored is stream messages
	// per job (all streams), byStream the same by stream; api is
	// JetStream API requests per job.
	in, out, stored, api float64
	byStream             map[string]float64
}

// cost returns the per-job cost of jobs between from and to; idle is a
// reading taken before from with nothing but the background running.
func cost(idle, from, to busCounts, jobs int) busCost {
	scale := 0.0
	if d := from.at.Sub(idle.at); d > 0 {
		scale = to.at.Sub(from.at).Seconds() / d.Seconds()
	}
	net := func(i0, f, t float64) float64 { return ((t - f) - scale*(f-i0)) / float64(jobs) }
	c := busCost{jobs: jobs, byStream: map[string]float64{},
		in:  net(float64(idle.in), float64(from.in), float64(to.in)),
		out: net(float64(idle.out), float64(from.out), float64(to.out)),
		api: net(float64(idle.api), float64(from.api), float64(to.api))}
	for name, seq := range to.stored {
		// A stream created meanwhile (the raw publish's) counts from 0.
		v := net(float64(idle.stored[name]), float64(from.stored[name]), float64(seq))
		if name == rawStream || v < 0.005 {
			continue
		}
		c.byStream[name] = v
		c.stored += v
	}
	return c
}

// consumerKind names a consumer without the random part of an ordered or
// ephemeral one's name, so that consumers of one kind add up.
func consumerKind(name string) string {
	if i := strings.LastIndexByte(name, '_'); i > 0 && len(name)-i > 6 {
		return name[:i] + "_*"
	}
	if len(name) >= 20 && !strings.ContainsAny(name, "-.") {
		return "(ephemeral)"
	}
	return name
}

// deliveries lists what each consumer delivered per job between from and
// to, less the background measured from idle to from as cost does (the
// heartbeat and telemetry readers deliver while nothing runs), most
// first: the fan-out of the bus to the platform's readers.
func deliveries(idle, from, to busCounts, jobs int) string {
	scale := 0.0
	if d := from.at.Sub(idle.at); d > 0 {
		scale = to.at.Sub(from.at).Seconds() / d.Seconds()
	}
	type row struct {
		name string
		n    float64
	}
	var rows []row
	var total float64
	for name, n := range to.delivered {
		f, i := float64(from.delivered[name]), float64(idle.delivered[name])
		if f < i {
			i = f // a consumer made between the readings
		}
		if d := ((float64(n) - f) - scale*(f-i)) / float64(jobs); d >= 0.005 {
			rows = append(rows, row{name, d})
			total += d
		}
	}
	slices.SortFunc(rows, func(a, b row) int { return cmp.Compare(b.n, a.n) })
	parts := make([]string, 0, len(rows))
	for _, r := range rows {
		parts = append(parts, fmt.Sprintf("%s %.2f", r.name, r.n))
	}
	return fmt.Sprintf("JetStream deliveries per job: %.2f (%s)", total, strings.Join(parts, ", "))
}

// String lists the cost, streams by name.
func (c busCost) String() string {
	names := make([]string, 0, len(c.byStream))
	for n := range c.byStream {
		names = append(names, n)
	}
	slices.Sort(names)
	parts := make([]string, 0, len(names))
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s %.2f", n, c.byStream[n]))
	}
	return fmt.Sprintf("per job: %.1f server msgs in, %.1f out, %.2f stored (%s), %.2f JetStream API requests",
		c.in, c.out, c.stored, strings.Join(parts, ", "), c.api)
}

// rawStream is the stream rawPublishRate writes to.
const rawStream = "BENCH_RAW"

// processCPU is the CPU time (user and system) this process has used so
// far. The benchmarks run the whole platform in it (NATS, every service,
// every agent), so the CPU a burst took per job is what the platform costs
// per job: a figure that a shared, busy machine skews far less than it
// skews rates and latencies, which wait for CPU others hold.
func processCPU() time.Duration {
	ru := rusage()
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// rusage is this process's resource usage (zero if it cannot be read).
func rusage() syscall.Rusage {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return syscall.Rusage{}
	}
	return ru
}

// reportNetCPU reports the CPU per job less the platform's background
// (heartbeats, telemetry, liveness checks: what it burnt from idle to
// from, a quiet second) over the window since start: cpu-ms/job charges
// a job with the background of the seconds it took, which on a busy
// machine are many.
func reportNetCPU(b *testing.B, perJob time.Duration, idle, from busCounts, start time.Time, jobs int) {
	b.Helper()
	d := from.at.Sub(idle.at)
	if d <= 0 {
		return
	}
	rate := float64(from.cpu-idle.cpu) / float64(d) // CPU seconds per second
	bg := time.Duration(rate * float64(time.Since(start)) / float64(max(jobs, 1)))
	net := perJob - bg
	b.ReportMetric(float64(net.Microseconds())/1000, "net-cpu-ms/job")
	b.Logf("background (idle platform) %.0f ms CPU per second: %s of the %s per job; net %s per job",
		rate*1000, bg.Round(time.Microsecond), perJob.Round(time.Microsecond), net.Round(time.Microsecond))
}

// reportCPU reports the CPU used per job (cpu since from, over jobs) and
// the rate the machine's cores would reach if that CPU were all a job
// needed (GOMAXPROCS cores fully used): the rate a quiet machine gives a
// CPU-bound platform.
func reportCPU(b *testing.B, from time.Duration, jobs int) (perJob time.Duration, bound float64) {
	b.Helper()
	perJob = (processCPU() - from) / time.Duration(max(jobs, 1))
	bound = float64(runtime.GOMAXPROCS(0)) / perJob.Seconds()
	b.ReportMetric(float64(perJob.Microseconds())/1000, "cpu-ms/job")
	b.ReportMetric(bound, "cpu-bound-jobs/s")
	return perJob, bound
}
