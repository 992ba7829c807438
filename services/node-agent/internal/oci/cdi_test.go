package oci

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// fakeMachine is an 8-GPU machine whose last two GPUs are in MIG mode
// with two instances each; GPU minors are not their indexes (as on real
// machines, where NVML's order and the driver's minors differ).
func fakeMachine() (device.Machine, Host) {
	var m device.Machine
	h := Host{DevRoot: "/dev", Minors: map[string]int{}, ControlDevices: controlDevices,
		Libraries: []string{"/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"},
		Binaries:  []string{"/usr/bin/nvidia-smi"}}
	var table strings.Builder
	table.WriteString("config 1\nmonitor 2\n")
	for i := range 8 {
		g := contracts.GPUInfo{Index: i, UUID: fmt.Sprintf("GPU-%d", i), Model: "H100-80GB"}
		minor := 7 - i
		h.Minors[g.UUID] = minor
		if i >= 6 {
			g.MIGEnabled = true
			for gi := 1; gi <= 2; gi++ {
				g.MIGInstances = append(g.MIGInstances, contracts.MIGInstance{UUID: fmt.Sprintf("MIG-%d-%d", i, gi), Profile: "3g.40gb", GIID: gi, CIID: 0})
			}
		}
		// The driver's numbering: per GPU minor, per GPU instance, its
		// access and its compute instances' access.
		for gi := 0; gi < 15; gi++ {
			fmt.Fprintf(&table, "gpu%d/gi%d/access %d\n", minor, gi, 3+minor*135+gi*9)
			for ci := 0; ci < 8; ci++ {
				fmt.Fprintf(&table, "gpu%d/gi%d/ci%d/access %d\n", minor, gi, ci, 3+minor*135+gi*9+1+ci)
			}
		}
		m.GPUs = append(m.GPUs, g)
	}
	h.MIGMinors = ParseMIGMinors(strings.NewReader(table.String()))
	return m, h
}

func TestEditsForHoldExactlyTheAllocatedDevices(t *testing.T) {
	m, h := fakeMachine()
	spec, err := GenerateCDI(m, h)
	if err != nil {
		t.Fatal(err)
	}
	if len(spec.Devices) != 8+4 {
		t.Fatalf("%d CDI devices, want 12 (8 GPUs, 4 MIG instances)", len(spec.Devices))
	}
	gpu := func(i int) contracts.DeviceRef {
		return contracts.DeviceRef{Index: i, UUID: m.GPUs[i].UUID, Model: "H100-80GB"}
	}
	mig := func(i, n int) contracts.DeviceRef {
		d := gpu(i)
		mi := m.GPUs[i].MIGInstances[n]
		d.MIG = &mi
		return d
	}
	share := func(i int) contracts.DeviceRef {
		d := gpu(i)
		d.Share = &contracts.GPUShare{MemoryMiB: 8192, ComputePercent: 25}
		return d
	}
	control := []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
	tests := map[string]struct {
		devs []contracts.DeviceRef
		want []string
	}{
		"one GPU":                     {devs: []contracts.DeviceRef{gpu(0)}, want: append([]string{"/dev/nvidia7"}, control...)},
		"two GPUs":                    {devs: []contracts.DeviceRef{gpu(1), gpu(4)}, want: append([]string{"/dev/nvidia6", "/dev/nvidia3"}, control...)},
		"a share sees its whole GPU":  {devs: []contracts.DeviceRef{share(2)}, want: append([]string{"/dev/nvidia5"}, control...)},
		"a MIG instance, second of 2": {devs: []contracts.DeviceRef{mig(6, 1)}, want: append([]string{"/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap" + fmt.Sprint(3+1*135+2*9), "/dev/nvidia-caps/nvidia-cap" + fmt.Sprint(3+1*135+2*9+1)}, control...)},
		"two MIG instances, two GPUs": {devs: []contracts.DeviceRef{mig(6, 0), mig(7, 0)}, want: append([]string{
			"/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap" + fmt.Sprint(3+135+9), "/dev/nvidia-caps/nvidia-cap" + fmt.Sprint(3+135+9+1),
			"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap" + fmt.Sprint(3+9), "/dev/nvidia-caps/nvidia-cap" + fmt.Sprint(3+9+1)}, control...)},
		"nothing": {devs: nil, want: nil},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			e, err := EditsFor(spec, tt.devs)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, n := range e.DeviceNodes {
				got = append(got, n.Path)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("device nodes (-want +got):\n%s", diff)
			}
			var mounts []string
			for _, mt := range e.Mounts {
				mounts = append(mounts, mt.ContainerPath)
				if !slices.Contains(mt.Options, "ro") {
					t.Errorf("driver file %s mounted writable", mt.HostPath)
				}
			}
			if want := slices.Concat(h.Libraries, h.Binaries); len(tt.devs) > 0 && !cmp.Equal(want, mounts) {
				t.Errorf("driver files %v, want %v", mounts, want)
			}
		})
	}

	t.Run("a device the machine lacks", func(t *testing.T) {
		if _, err := EditsFor(spec, []contracts.DeviceRef{{Index: 9, UUID: "GPU-elsewhere"}}); err == nil {
			t.Error("edits for a GPU of another machine")
		}
	})
}

func TestGenerateCDISimulated(t *testing.T) {
	m, _ := fakeMachine()
	spec, err := GenerateCDI(m, Host{Simulated: true})
	if err != nil {
		t.Fatal(err)
	}
	e, err := EditsFor(spec, []contracts.DeviceRef{{Index: 0, UUID: "GPU-0"}, {Index: 6, UUID: "GPU-6", MIG: &m.GPUs[6].MIGInstances[0]}})
	if err != nil {
		t.Fatal(err)
	}
	if len(e.DeviceNodes)+len(e.Mounts) != 0 {
		t.Errorf("a simulated machine's devices have edits: %+v", e)
	}
}

func TestGenerateCDIWithoutMIGMinors(t *testing.T) {
	m, h := fakeMachine()
	h.MIGMinors = nil
	spec, err := GenerateCDI(m, h)
	if err == nil {
		t.Error("no error for MIG instances whose capability devices are unknown")
	}
	// Whole GPUs still run; the MIG instances do not, rather than seeing
	// their whole GPU.
	if _, err := EditsFor(spec, []contracts.DeviceRef{{Index: 1, UUID: "GPU-1"}}); err != nil {
		t.Errorf("whole GPU: %v", err)
	}
	if _, err := EditsFor(spec, []contracts.DeviceRef{{Index: 6, UUID: "GPU-6", MIG: &m.GPUs[6].MIGInstances[0]}}); err == nil {
		t.Error("a MIG instance without its capability devices would launch")
	}
}
