package scale

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// schedProfile takes the scheduler's CPU profile through its opt-in
// pprof listener (GPUPLANE_SCALE_PPROF=1 gives it one): the cycle's cost
// with a large queue and a busy fleet, in the whole platform, is where
// the state package's benchmarks cannot see (lock waits, the follows
// beside the cycles, the snapshotter).
type schedProfile struct {
	addr string // the scheduler's GPUPLANE_PPROF_ADDR; empty when off
	dir  string
	done chan struct{}
}

func newSchedProfile(b *testing.B, dir string) *schedProfile {
	p := &schedProfile{dir: dir}
	if os.Getenv("GPUPLANE_SCALE_PPROF") == "1" {
		p.addr = freeAddr(b)
	}
	return p
}

// env is what the scheduler's environment gets.
func (p *schedProfile) env() []string {
	if p.addr == "" {
		return nil
	}
	return []string{"GPUPLANE_PPROF_ADDR=" + p.addr}
}

// start takes a CPU profile of the next secs seconds into the kept
// directory (scheduler-cpu.pprof), in the background; once per run.
func (p *schedProfile) start(b *testing.B, secs int) {
	if p.addr == "" || p.done != nil {
		return
	}
	p.done = make(chan struct{})
	// Also on a b.Fatal before the benchmark's own wait: the
	// goroutine's b.Logf must not outlive the benchmark.
	b.Cleanup(p.wait)
	go func() {
		defer close(p.done)
		path := filepath.Join(p.dir, "scheduler-cpu.pprof")
		if err := fetchProfile(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", p.addr, secs), path, time.Duration(secs+30)*time.Second); err != nil {
			b.Logf("scheduler CPU profile: %v", err)
			return
		}
		b.Logf("scheduler CPU profile (%d s) in %s", secs, path)
	}()
}

// wait waits for a profile started to be saved.
func (p *schedProfile) wait() {
	if p.done != nil {
		<-p.done
	}
}

func fetchProfile(url, path string, timeout time.Duration) error {
	c := http.Client{Timeout: timeout}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("%s: %s", resp.Status, body)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
