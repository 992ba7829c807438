package oci_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/nvmlgpu"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci/ocitest"
)

// RealGPUEnv runs TestRealGPUContainerSeesExactlyItsGPU, on a machine with
// NVIDIA GPUs and their driver (GPUPLANE_REAL_GPU=1 go test -run RealGPU
// ./services/node-agent/internal/oci/ as root).
const RealGPUEnv = "GPUPLANE_REAL_GPU"

// TestRealGPUContainerSeesExactlyItsGPU runs nvidia-smi -L in a container
// given each GPU of the machine in turn, from the CDI spec made of what
// NVML discovered, as the agent makes it: it must list that GPU and no
// other. The image is busybox with the host's C library (nvidia-smi is
// dynamically linked); the driver's files come from the CDI edits.
func TestRealGPUContainerSeesExactlyItsGPU(t *testing.T) {
	if os.Getenv(RealGPUEnv) != "1" {
		t.Skipf("needs NVIDIA GPUs: %s=1 runs it", RealGPUEnv)
	}
	rt := ocitest.Runtime(t)
	b, err := nvmlgpu.Open(nvmlgpu.Config{NodeID: "real"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	m, err := b.Discover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	host := oci.DiscoverHost(m, false)
	spec, err := oci.GenerateCDI(m, host)
	if err != nil {
		t.Logf("CDI: %v", err)
	}
	smi := ""
	for _, p := range host.Binaries {
		if filepath.Base(p) == "nvidia-smi" {
			smi = p
		}
	}
	if smi == "" || len(m.GPUs) == 0 {
		t.Fatalf("no nvidia-smi (%v) or no GPU (%d) found", host.Binaries, len(m.GPUs))
	}
	img := ocitest.Image(t)
	withHostLibc(t, img.RootFS, smi)
	uuidRE := regexp.MustCompile(`UUID: ((GPU|MIG)-[0-9a-f-]+)`)
	for _, g := range m.GPUs {
		t.Run(g.UUID, func(t *testing.T) {
			edits, err := oci.EditsFor(spec, []contracts.DeviceRef{{Index: g.Index, UUID: g.UUID, Model: g.Model}})
			if err != nil {
				t.Fatal(err)
			}
			out, code := run(t, rt, oci.Config{Image: img, GPUs: edits, Command: []string{smi, "-L"},
				Env: []string{"CUDA_VISIBLE_DEVICES=" + g.UUID, "NVIDIA_VISIBLE_DEVICES=" + g.UUID}})
			if code != 0 {
				t.Fatalf("nvidia-smi -L exited %d:\n%s", code, out)
			}
			var seen []string
			for _, mm := range uuidRE.FindAllStringSubmatch(out, -1) {
				if mm[2] == "GPU" {
					seen = append(seen, mm[1])
				}
			}
			if len(seen) != 1 || seen[0] != g.UUID {
				t.Errorf("the container sees GPUs %v, want exactly %s:\n%s", seen, g.UUID, out)
			}
		})
	}
}

// withHostLibc copies into root the shared libraries ldd lists for
// program, at their paths, with the dynamic loader.
func withHostLibc(t *testing.T, root, program string) {
	t.Helper()
	out, err := exec.Command("ldd", program).Output()
	if err != nil {
		t.Fatalf("ldd %s: %v", program, err)
	}
	for _, f := range strings.Fields(string(out)) {
		if !strings.HasPrefix(f, "/") {
			continue
		}
		real, err := filepath.EvalSymlinks(f)
		if err != nil {
			continue
		}
		b, err := os.ReadFile(real)
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(root, f)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}
