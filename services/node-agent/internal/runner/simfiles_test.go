package runner

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestASimulatedRunMakesNoFile: a simulated run holds its output in
// memory, from its start to its end (the agent ships it from there), and
// makes no file: no log, no checkpoint directory until it checkpoints, no
// state directory. A log directory removed under the runner changes
// nothing.
func TestASimulatedRunMakesNoFile(t *testing.T) {
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
		if info := p.Info(); !info.Simulated || info.PID != 0 || info.LogPath != "" {
			t.Fatalf("%s: info %+v", c.id, info)
		}
		mem := make([]byte, 64)
		n, _ := p.(*simProc).ReadAt(mem, 0)
		if !strings.HasPrefix(string(mem[:n]), "simulated run of 1h0m0s on [GPU-a]") || int64(n) != p.(*simProc).Size() {
			t.Fatalf("%s: output in memory %q (size %d)", c.id, mem[:n], p.(*simProc).Size())
		}
		p.Stop(0)
		waitExit(t, p, limit)
		if out := simOutput(p); !strings.HasPrefix(out, "simulated run of 1h0m0s on [GPU-a]") {
			t.Fatalf("%s: output after its end %q", c.id, out)
		}
	}
	if _, err := os.Stat(r.CheckpointDir); !os.IsNotExist(err) {
		t.Fatalf("checkpoint root made by runs that never checkpointed: %v", err)
	}
	// Not even the log directory: a simulated run writes no log.
	if entries, err := os.ReadDir(r.LogDir); !os.IsNotExist(err) {
		t.Fatalf("log dir made by simulated runs (holds %v, %v)", entries, err)
	}
}
