package mps_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/mps/mpstest"
)

// BenchmarkAcquire is what MPS adds to a share's launch: "cold" starts the
// GPU's daemon (the first share of the GPU; the stand-in's start, through
// unshare where this runs as root, then the wait for its pid file and
// control pipe) and stops it again, "warm" holds a daemon that is up
// already (every later share).
func BenchmarkAcquire(b *testing.B) {
	const gpu = "GPU-bench000-0000-0000-0000-000000000000"
	for _, warm := range []bool{false, true} {
		name := map[bool]string{false: "cold", true: "warm"}[warm]
		b.Run(name, func(b *testing.B) {
			c := mpstest.New(b)
			s, err := mps.New(mps.Config{Control: c.Path, Root: mpstest.Root(b), PollInterval: time.Second,
				QuitTimeout: 5 * time.Second, HostShm: !mpstest.PrivateShm(), Log: slog.New(slog.DiscardHandler)})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			ctx := context.Background()
			if warm {
				l, err := s.Acquire(ctx, gpu)
				if err != nil {
					b.Fatal(err)
				}
				defer l.Release()
			}
			b.ResetTimer()
			for b.Loop() {
				l, err := s.Acquire(ctx, gpu)
				if err != nil {
					b.Fatal(err)
				}
				if s.PID(gpu) == 0 {
					b.Fatal("Acquire returned with no daemon up")
				}
				l.Release()
				if !warm {
					// Not timed: the stop of the last share's daemon.
					b.StopTimer()
					deadline := time.Now().Add(10 * time.Second)
					for len(c.Daemons("")) > 0 || s.State(gpu) != "none" {
						if time.Now().After(deadline) {
							b.Fatal("the daemon did not stop after the last release")
						}
						time.Sleep(time.Millisecond)
					}
					b.StartTimer()
				}
			}
		})
	}
}
