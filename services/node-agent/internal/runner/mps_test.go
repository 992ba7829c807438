package runner

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// mpsDirs makes a GPU's MPS pipe and shm directories as the MPS
// supervisor does (open to all, sticky), each with a file a daemon would
// keep there.
func mpsDirs(t *testing.T) (pipe, shm string) {
	t.Helper()
	root := t.TempDir()
	pipe, shm = filepath.Join(root, "pipe"), filepath.Join(root, "shm")
	for _, d := range []struct{ dir, file string }{{pipe, "control"}, {shm, "server-segment"}} {
		if err := os.Mkdir(d.dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d.dir, 0o777|os.ModeSticky); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d.dir, d.file), nil, 0o666); err != nil {
			t.Fatal(err)
		}
	}
	return pipe, shm
}

// A share's run meets its GPU's MPS daemon where the daemon is: in the
// pipe directory CUDA_MPS_PIPE_DIRECTORY names, and in the daemon's
// /dev/shm, which is the run's own /dev/shm (never the host's), whether it
// is a host command or a container.
func TestAShareMeetsItsMPSDaemon(t *testing.T) {
	const script = `echo "pipe=$(ls "$CUDA_MPS_PIPE_DIRECTORY")"; echo "shm=$(ls /dev/shm)"; echo "pid=$$"; touch /dev/shm/client-` + "$1"
	for name, container := range map[string]bool{"host command": false, "container": true} {
		t.Run(name, func(t *testing.T) {
			if !container && os.Geteuid() != 0 {
				t.Skip("a share's host command gets its own /dev/shm through unshare and mount, which need root")
			}
			pipe, shm := mpsDirs(t)
			marker := "client-" + strconv.Itoa(os.Getpid()) + "-" + strings.ReplaceAll(name, " ", "-")
			var (
				r *Local
				l Launch
			)
			if container {
				var c Container
				r, _, c = containerLocal(t)
				l = containerLaunch(c, script)
			} else {
				r = &Local{LogDir: t.TempDir()}
				l = newLaunch(contracts.RunSpec{Command: []string{"/bin/sh", "-c", script}}, gpus("GPU-b"))
			}
			l.Spec.Command = append(l.Spec.Command, "sh", strings.TrimPrefix(marker, "client-"))
			l.Devices[0].Share = &contracts.GPUShare{MemoryMiB: 4096, ComputePercent: 25}
			l.MPSPipeDir, l.MPSShmDir = pipe, shm
			p := start(t, r, l)
			if exit := waitExit(t, p, limit); exit.Code != 0 || exit.Err != nil {
				out, _ := os.ReadFile(p.Info().LogPath)
				t.Fatalf("exit %+v; log:\n%s", exit, out)
			}
			out, _ := os.ReadFile(p.Info().LogPath)
			for _, want := range []string{"pipe=control\n", "shm=server-segment\n"} {
				if !strings.Contains(string(out), want) {
					t.Errorf("log lacks %q:\n%s", want, out)
				}
			}
			if !container && !strings.Contains(string(out), "pid="+strconv.Itoa(p.Info().PID)+"\n") {
				t.Errorf("the command is not the process the shim started (pid %d), so SIGUSR1 would miss it:\n%s", p.Info().PID, out)
			}
			if _, err := os.Stat(filepath.Join(shm, marker)); err != nil {
				t.Errorf("what the run wrote in its /dev/shm is not in the daemon's: %v", err)
			}
			if _, err := os.Stat(filepath.Join("/dev/shm", marker)); !os.IsNotExist(err) {
				t.Errorf("the run wrote in the host's /dev/shm (%v)", err)
				_ = os.Remove(filepath.Join("/dev/shm", marker))
			}
		})
	}
}
