package oci_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci/ocitest"
)

// container is one container of a test, started by runc in the
// foreground as the shim starts it.
type container struct {
	id     string
	bundle oci.Bundle
	cmd    *exec.Cmd
	out    *bytes.Buffer
}

func start(t *testing.T, rt oci.Runtime, c oci.Config) *container {
	t.Helper()
	if c.ID == "" {
		c.ID = oci.ContainerID("acme/" + strings.ReplaceAll(t.Name(), "/", "-") + "/1")
	}
	b, err := oci.CreateBundle(filepath.Join(t.TempDir(), "bundle"), c)
	if err != nil {
		t.Fatalf("bundle: %v", err)
	}
	t.Cleanup(func() {
		_ = rt.Delete(context.Background(), c.ID, true)
		if err := oci.RemoveBundle(b.Dir); err != nil {
			t.Errorf("remove bundle: %v", err)
		}
	})
	out := &bytes.Buffer{}
	argv := rt.RunArgv(b.Dir, c.ID, filepath.Join(t.TempDir(), "pid"))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return &container{id: c.ID, bundle: b, cmd: cmd, out: out}
}

// wait returns the container's output and exit status.
func (c *container) wait(t *testing.T) (string, int) {
	t.Helper()
	err := c.cmd.Wait()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return c.out.String(), c.cmd.ProcessState.ExitCode()
}

func run(t *testing.T, rt oci.Runtime, c oci.Config) (string, int) {
	t.Helper()
	return start(t, rt, c).wait(t)
}

// report parses the key=value lines a container's script prints.
func report(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(l), "="); ok {
			m[k] = v
		}
	}
	return m
}

func sh(script string) []string { return []string{"/bin/sh", "-c", script} }

// probe prints what a container sees of itself.
const probe = `
echo "uid=$(id -u)"
echo "gid=$(id -g)"
echo "self=$$"
echo "pid1=$(cat /proc/1/comm)"
echo "procs=$(ls /proc | grep -c '^[0-9]')"
if [ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then echo "mem=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes)"; else echo "mem=$(cat /sys/fs/cgroup/memory.max)"; fi
touch /data/probe 2>/dev/null && echo data=writable || echo data=read-only
touch /scratch/probe 2>/dev/null && echo scratch=writable || echo scratch=read-only
touch /work/probe 2>/dev/null && echo root=writable || echo root=read-only
touch /tmp/probe 2>/dev/null && echo tmp=writable || echo tmp=read-only
echo "host=$(hostname)"
echo "var=$IMAGE_VAR"
echo "job=$GPUPLANE_JOB_ID"
exit 3
`

func TestContainerIsolation(t *testing.T) {
	rt := ocitest.Runtime(t)
	img := ocitest.Image(t)
	data, scratch := t.TempDir(), t.TempDir()
	if err := os.Chmod(scratch, 0o777); err != nil {
		t.Fatal(err)
	}
	for _, overlay := range []bool{true, false} {
		t.Run(fmt.Sprintf("overlay=%v", overlay), func(t *testing.T) {
			defer oci.SetOverlay(overlay)()
			c := oci.Config{
				Image: img, Command: sh(probe), Env: []string{"GPUPLANE_JOB_ID=job-1"},
				Mounts:    []oci.Mount{{Source: data, Target: "/data", ReadOnly: true}, {Source: scratch, Target: "/scratch"}},
				MemoryMiB: 64, CPUMilli: 500,
			}
			out, code := run(t, rt, c)
			if code != 3 {
				t.Fatalf("exit code %d, want 3 (the script's); output:\n%s", code, out)
			}
			want := map[string]string{
				"uid": "65534", "gid": "65534", // the image's root is not the job's
				"self": "1", "pid1": "sh", // its own PID namespace
				"mem":  fmt.Sprint(64 << 20),
				"data": "read-only", "scratch": "writable", "tmp": "writable",
				"var": "image", "job": "job-1",
			}
			got := report(out)
			for k, v := range want {
				if got[k] != v {
					t.Errorf("%s = %q, want %q; output:\n%s", k, got[k], v, out)
				}
			}
			// sh, ls and grep at most: nothing of the host's.
			if n, err := strconv.Atoi(got["procs"]); err != nil || n > 4 {
				t.Errorf("the container sees %q processes, want only its own (<= 4)", got["procs"])
			}
			if !strings.HasPrefix(got["host"], "gp-acme_") {
				t.Errorf("hostname %q, want its container ID (its own UTS namespace)", got["host"])
			}
			// Overlay: the root is the run's own, written to its upper layer;
			// the fallback's root is the image, read-only.
			wantRoot := map[bool]string{true: "writable", false: "read-only"}[overlay]
			if got["root"] != wantRoot {
				t.Errorf("root is %s, want %s", got["root"], wantRoot)
			}
			if _, err := os.Stat(filepath.Join(img.RootFS, "work/probe")); err == nil {
				t.Error("the run wrote into the shared image")
			}
			if _, err := os.Stat(filepath.Join(data, "probe")); err == nil {
				t.Error("the run wrote into its read-only mount")
			}
		})
	}
}

func TestContainersCannotSeeEachOther(t *testing.T) {
	rt := ocitest.Runtime(t)
	img := ocitest.Image(t)
	signal := t.TempDir()
	if err := os.Chmod(signal, 0o777); err != nil {
		t.Fatal(err)
	}
	a := start(t, rt, oci.Config{ID: oci.ContainerID("acme/a/1"), Image: img,
		Mounts:  []oci.Mount{{Source: signal, Target: "/signal"}},
		Command: sh(`echo secret > /tmp/a-secret; echo $$ > /signal/ready; exec sleep 600`)})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(filepath.Join(signal, "ready")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("container a did not start: %s", a.out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	out, code := run(t, rt, oci.Config{ID: oci.ContainerID("other/b/1"), Image: img, Command: sh(`
test -e /tmp/a-secret && echo file=seen || echo file=unseen
echo "sleepers=$(cat /proc/[0-9]*/comm 2>/dev/null | grep -c -x sleep)"
test -e /signal/ready && echo mount=seen || echo mount=unseen
`)})
	if code != 0 {
		t.Fatalf("container b exited %d:\n%s", code, out)
	}
	if diff := cmp.Diff(map[string]string{"file": "unseen", "sleepers": "0", "mount": "unseen"}, report(out)); diff != "" {
		t.Errorf("what b sees of a (-want +got):\n%s", diff)
	}
	st, err := rt.State(context.Background(), a.id)
	if err != nil || !st.Running() {
		t.Fatalf("state of a: %+v, %v", st, err)
	}
	if err := rt.Kill(context.Background(), a.id, syscall.SIGKILL, true); err != nil {
		t.Fatal(err)
	}
	if _, code := a.wait(t); code != 128+int(syscall.SIGKILL) {
		t.Errorf("a killed exited %d, want %d", code, 128+int(syscall.SIGKILL))
	}
	// runc run deletes what it created once the container ended.
	if _, err := rt.State(context.Background(), a.id); !errors.Is(err, oci.ErrNoContainer) {
		t.Errorf("state of ended a: %v, want ErrNoContainer", err)
	}
}

// TestContainerSeesOnlyItsGPUs gives an 8-GPU machine (with MIG
// instances) device nodes of its own (null devices named as the driver's)
// and checks that a container sees exactly the nodes of its allocation.
func TestContainerSeesOnlyItsGPUs(t *testing.T) {
	rt := ocitest.Runtime(t)
	img := ocitest.Image(t)
	m, h := oci.FakeMachine()
	h.DevRoot = t.TempDir()
	h.Libraries, h.Binaries = nil, nil
	spec, err := oci.GenerateCDI(m, h)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range spec.Devices {
		for _, n := range d.ContainerEdits.DeviceNodes {
			mknod(t, n.HostPath)
		}
	}
	for _, n := range spec.ContainerEdits.DeviceNodes {
		mknod(t, n.HostPath)
	}
	mig := m.GPUs[6].MIGInstances[1]
	devs := []contracts.DeviceRef{{Index: 2, UUID: m.GPUs[2].UUID}, {Index: 6, UUID: m.GPUs[6].UUID, MIG: &mig}}
	edits, err := oci.EditsFor(spec, devs)
	if err != nil {
		t.Fatal(err)
	}
	out, code := run(t, rt, oci.Config{Image: img, GPUs: edits, Command: sh(`
echo "dev=$(ls /dev | grep nvidia | tr '\n' ' ')"
echo "caps=$(ls /dev/nvidia-caps | tr '\n' ' ')"
cat /dev/nvidia5 /dev/nvidia1 /dev/nvidiactl && echo open=ok
`)})
	if code != 0 {
		t.Fatalf("exit %d:\n%s", code, out)
	}
	got := report(out)
	if want := "nvidia-caps nvidia-uvm nvidia-uvm-tools nvidia1 nvidia5 nvidiactl"; got["dev"] != want {
		t.Errorf("/dev holds %q, want %q (GPU 2 is minor 5, GPU 6 minor 1)", got["dev"], want)
	}
	if want := fmt.Sprintf("nvidia-cap%d nvidia-cap%d", 3+135+18, 3+135+19); got["caps"] != want {
		t.Errorf("/dev/nvidia-caps holds %q, want %q", got["caps"], want)
	}
	if got["open"] != "ok" {
		t.Errorf("the allocated nodes cannot be opened (device cgroup):\n%s", out)
	}
}

func mknod(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	// A null device (1:3) under the driver's name.
	if err := syscall.Mknod(path, syscall.S_IFCHR|0o666, 1<<8|3); err != nil && !errors.Is(err, os.ErrExist) {
		t.Fatal(err)
	}
}
