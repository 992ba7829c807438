package runner

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestASimulatedRunMakesOnlyItsLog: a simulated run holds its output in
// memory while it runs (nothing on disk: a start costs no file) and writes
// its log when it ends, and nothing else (no checkpoint directory until it
// checkpoints, no state directory); a log directory removed under the
// runner is made again by the next run's end.
func TestASimulatedRunMakesOnlyItsLog(t *testing.T) {
	root := t.TempDir()
	r := &Local{LogDir: filepath.Join(root, "logs"), CheckpointDir: filepath.Join(root, "ckpt")}
	for i, c := range []struct {
		before func()
		id     string
	}{
		{func() {}, "acme/job-1/1"},
		{func() {}, "acme/job-1/2"},
		{func() {
			if err := os.RemoveAll(r.LogDir); err != nil {
				t.Fatal(err)
			}
		}, "acme/job-1/3"},
	} {
		c.before()
		l := newLaunch(contracts.RunSpec{Duration: contracts.Duration(time.Hour)}, gpus("GPU-a"))
		l.AllocationID, l.Attempt = c.id, i+1
		p := start(t, r, l)
		if info := p.Info(); !info.Simulated || info.PID != 0 || info.LogPath != LogPath(r.LogDir, c.id) {
			t.Fatalf("%s: info %+v", c.id, info)
		}
		if _, err := os.Stat(LogPath(r.LogDir, c.id)); !os.IsNotExist(err) {
			t.Fatalf("%s: a running simulated run has a log file (%v)", c.id, err)
		}
		mem := make([]byte, 64)
		n, _ := p.(*simProc).ReadAt(mem, 0)
		if !strings.HasPrefix(string(mem[:n]), "simulated run of 1h0m0s on [GPU-a]") || int64(n) > p.(*simProc).Size() {
			t.Fatalf("%s: output in memory %q (size %d)", c.id, mem[:n], p.(*simProc).Size())
		}
		p.Stop(0)
		waitExit(t, p, limit)
		out, err := os.ReadFile(LogPath(r.LogDir, c.id))
		if err != nil || !strings.HasPrefix(string(out), "simulated run of 1h0m0s on [GPU-a]") {
			t.Fatalf("%s: log %q: %v", c.id, out, err)
		}
	}
	if _, err := os.Stat(r.CheckpointDir); !os.IsNotExist(err) {
		t.Fatalf("checkpoint root made by runs that never checkpointed: %v", err)
	}
	entries, err := os.ReadDir(r.LogDir)
	if err != nil || len(entries) != 1 || entries[0].Name() != filepath.Base(LogPath(r.LogDir, "acme/job-1/3")) {
		t.Fatalf("log dir holds %v (%v), want the last run's log only", entries, err)
	}
}
