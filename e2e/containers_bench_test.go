package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkContainerStartOverhead measures what running a job as a
// container costs at its start, against the same job as a host command,
// in one run on one machine: N jobs of each, alternating, one at a time,
// through the whole platform. Each job's first action touches a file on
// the host (the container's through a mount), whose modification time
// the kernel sets: that is its first output line. submit->running is the
// client's submit to the running event (which follows the agent's started
// fact, however the runner stamps it); scheduled->first line is the
// scheduler's placement to that first action: the ledger's commit, the
// agent's launch (an image cache hit for the container: the image is
// pulled once before, pulls are not start-up) and the process's start;
// submit->first line is the whole. It reports p50 and p90 of each, in ms.
func BenchmarkContainerStartOverhead(b *testing.B) {
	bb, why := containerSupport()
	if why != "" {
		b.Skip(why)
	}
	const n = 20
	pub := startRegistry(b, "", "")
	ref := pub.push(b, "e2e/busybox:bench", busyboxImage(b, bb, nil))
	stamps := b.TempDir()
	if err := os.Chmod(stamps, 0o777); err != nil {
		b.Fatal(err)
	}
	s := startStack(b, containerFleet())
	h := s.watchHistory(b)
	setPoolRuntime(b, s, h, "ctr", contracts.PoolRuntime{AllowHostCommands: true, MountRoots: []string{stamps}}, ref)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	type sample struct{ submitRunning, scheduledFirst, submitFirst time.Duration }
	run := func(id string, container bool) sample {
		var req contracts.JobRequest
		if container {
			req = containerJob(id, "ctr", "L4", ref, "touch /stamps/"+id+"; echo first")
			req.Run.Mounts = []contracts.Mount{{Source: stamps, Target: "/stamps"}}
		} else {
			req = containerJob(id, "ctr", "L4", "", "touch "+filepath.Join(stamps, id)+"; echo first")
		}
		submitted := time.Now()
		s.submitJob(b, ctx, "acme", req)
		scheduled := h.await(b, time.Minute, "acme/"+id, "scheduled", isType(contracts.EventScheduled, 1))
		running := h.await(b, time.Minute, "acme/"+id, "running", isType(contracts.EventRunning, 1))
		if ev := h.await(b, time.Minute, "acme/"+id, "its end", func(ev contracts.JobEvent) bool { return ev.State.Terminal() }); ev.Type != contracts.EventSucceeded {
			b.Fatalf("%s ended %s (%s: %s)", id, ev.Type, ev.Reason, ev.Message)
		}
		fi, err := os.Stat(filepath.Join(stamps, id))
		if err != nil {
			b.Fatalf("%s: %v", id, err)
		}
		first := fi.ModTime()
		return sample{submitRunning: running.Time.Sub(submitted), scheduledFirst: first.Sub(scheduled.Time), submitFirst: first.Sub(submitted)}
	}
	for range b.N {
		var host, ctr []sample
		for i := range n {
			host = append(host, run(fmt.Sprintf("host-%d-%d", b.N, i), false))
			ctr = append(ctr, run(fmt.Sprintf("ctr-%d-%d", b.N, i), true))
		}
		pct := func(ss []sample, f func(sample) time.Duration, p float64) float64 {
			ds := make([]time.Duration, len(ss))
			for i, s := range ss {
				ds[i] = f(s)
			}
			slices.Sort(ds)
			return float64(ds[int(p*float64(len(ds)-1))].Microseconds()) / 1000
		}
		sr := func(s sample) time.Duration { return s.submitRunning }
		pf := func(s sample) time.Duration { return s.scheduledFirst }
		sf := func(s sample) time.Duration { return s.submitFirst }
		var report strings.Builder
		fmt.Fprintf(&report, "start-up over %d jobs each (ms)     p50      p90\n", n)
		for _, row := range []struct {
			name string
			ss   []sample
			f    func(sample) time.Duration
			unit string
		}{
			{"host      submit->running", host, sr, "host-submit-running-p"},
			{"container submit->running", ctr, sr, "ctr-submit-running-p"},
			{"host      scheduled->first line", host, pf, "host-scheduled-first-line-p"},
			{"container scheduled->first line", ctr, pf, "ctr-scheduled-first-line-p"},
			{"host      submit->first line", host, sf, "host-submit-first-line-p"},
			{"container submit->first line", ctr, sf, "ctr-submit-first-line-p"},
		} {
			p50, p90 := pct(row.ss, row.f, 0.5), pct(row.ss, row.f, 0.9)
			fmt.Fprintf(&report, "  %-33s %7.1f  %7.1f\n", row.name, p50, p90)
			b.ReportMetric(p50, row.unit+"50-ms")
			b.ReportMetric(p90, row.unit+"90-ms")
		}
		b.Log("\n" + report.String())
	}
}
