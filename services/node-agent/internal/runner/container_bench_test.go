package runner

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// BenchmarkStartOverhead measures what running a job as a container costs
// at its start, against the same job as a host command, in the same run:
// launch (Launch returns: the shim says the process exists), first output
// line in the run's log, and the whole run of a job that prints one line
// and exits (the benchmark's ns/op), through the agent's shim either way.
// A container's start includes its overlay mount, config.json, runc
// create/start (namespaces, cgroups, seccomp) and its removal at the end.
func BenchmarkStartOverhead(b *testing.B) {
	r, _, c := containerLocal(b)
	for _, kind := range []string{"host", "container"} {
		b.Run(kind, func(b *testing.B) {
			var launch, first time.Duration
			n := 0
			for b.Loop() {
				n++
				l := newLaunch(contracts.RunSpec{Command: []string{"/bin/sh", "-c", "echo ready"}}, gpus("GPU-a"))
				l.AllocationID = fmt.Sprintf("acme/bench-%s-%d/1", kind, n)
				l.JobID = fmt.Sprintf("bench-%s-%d", kind, n)
				if kind == "container" {
					cc := c
					l.Container = &cc
				}
				t0 := time.Now()
				p, err := r.Launch(context.Background(), l)
				if err != nil {
					b.Fatal(err)
				}
				launch += time.Since(t0)
				for {
					if out, _ := os.ReadFile(p.Info().LogPath); len(out) > 0 && out[len(out)-1] == '\n' {
						break
					}
					select {
					case <-p.Done():
						if out, _ := os.ReadFile(p.Info().LogPath); string(out) != "ready\n" {
							b.Fatalf("run ended with output %q, want %q", out, "ready\n")
						}
					default:
						time.Sleep(100 * time.Microsecond)
						continue
					}
					break
				}
				first += time.Since(t0)
				if e := p.Wait(); e.Code != 0 || e.Err != nil {
					b.Fatalf("exit %+v", e)
				}
				if err := r.Forget(l.AllocationID); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(launch.Microseconds())/float64(n)/1000, "launch-ms")
			b.ReportMetric(float64(first.Microseconds())/float64(n)/1000, "first-line-ms")
		})
	}
}
