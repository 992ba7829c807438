package oci

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	cdispecs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

// CDIKind is the kind of the CDI spec of a machine's GPUs: one CDI device
// per GPU and per MIG instance, named by the UUID CUDA_VISIBLE_DEVICES
// takes, as the NVIDIA Container Toolkit names them by UUID.
const CDIKind = "nvidia.com/gpu"

// Host is what a machine has of NVIDIA's driver, beyond what discovery
// reports: device minors, MIG capability minors, and the driver's
// user-space files. DiscoverHost reads it; tests build their own.
type Host struct {
	// Simulated is a machine without NVIDIA hardware (the simulated
	// backend): its GPUs have CDI devices with no edits, so a container
	// run takes the same path as on a real machine and gets no device.
	Simulated bool
	// DevRoot holds the device nodes, "/dev" when empty.
	DevRoot string
	// Minors maps a GPU UUID to its device minor, /dev/nvidia<minor>
	// (not always its index); a GPU missing here has its index.
	Minors map[string]int
	// MIGMinors is /proc/driver/nvidia-caps/mig-minors: the minor of
	// /dev/nvidia-caps/nvidia-cap<N> of "gpu<minor>/gi<id>/access" and
	// "gpu<minor>/gi<id>/ci<id>/access".
	MIGMinors map[string]int
	// ControlDevices are the driver's nodes every GPU container needs
	// (nvidiactl, nvidia-uvm, nvidia-uvm-tools), the names that exist.
	ControlDevices []string
	// Libraries and Binaries are the driver's user-space files (host
	// paths), mounted read-only at the same paths.
	Libraries, Binaries []string
}

// The driver's files a compute container needs, as the NVIDIA Container
// Toolkit's "compute,utility" capabilities list them.
var (
	driverLibraries = []string{
		"libcuda.so", "libcudadebugger.so", "libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-ptxjitcompiler.so",
		"libnvidia-nvvm.so", "libnvidia-gpucomp.so", "libnvidia-allocator.so", "libnvidia-opencl.so",
		"libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so",
	}
	driverBinaries  = []string{"nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"}
	libraryDirs     = []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu"}
	binaryDirs      = []string{"/usr/bin", "/usr/local/bin", "/usr/sbin"}
	controlDevices  = []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}
	errUnknownMinor = errors.New("no MIG capability minor")
)

// DiscoverHost reads what this machine has of the driver for machine m:
// simulated (no files, no nodes) when the backend is.
func DiscoverHost(m device.Machine, simulated bool) Host {
	h := Host{Simulated: simulated, DevRoot: "/dev", Minors: map[string]int{}}
	if simulated {
		return h
	}
	for _, g := range m.GPUs {
		if n, ok := gpuMinor(g.PCIBusID); ok {
			h.Minors[g.UUID] = n
		}
	}
	if f, err := os.Open("/proc/driver/nvidia-caps/mig-minors"); err == nil {
		h.MIGMinors = ParseMIGMinors(f)
		_ = f.Close()
	}
	for _, d := range controlDevices {
		if _, err := os.Stat(filepath.Join(h.DevRoot, d)); err == nil {
			h.ControlDevices = append(h.ControlDevices, d)
		}
	}
	seen := map[string]bool{}
	for _, dir := range libraryDirs {
		for _, lib := range driverLibraries {
			matches, _ := filepath.Glob(filepath.Join(dir, lib+".*"))
			for _, p := range matches {
				// A dangling link (a driver half removed) is no library.
				if _, err := filepath.EvalSymlinks(p); err == nil && !seen[p] {
					seen[p] = true
					h.Libraries = append(h.Libraries, p)
				}
			}
		}
	}
	for _, b := range driverBinaries {
		for _, dir := range binaryDirs {
			if p := filepath.Join(dir, b); fileExists(p) {
				h.Binaries = append(h.Binaries, p)
				break
			}
		}
	}
	return h
}

// gpuMinor reads a GPU's device minor from the driver's
// /proc/driver/nvidia/gpus/<bus id>/information.
func gpuMinor(busID string) (int, bool) {
	if busID == "" {
		return 0, false
	}
	// NVML's "00000000:17:00.0" is the driver's "0000:17:00.0".
	id := strings.ToLower(busID)
	if dom, rest, ok := strings.Cut(id, ":"); ok && len(dom) > 4 {
		id = dom[len(dom)-4:] + ":" + rest
	}
	f, err := os.Open(filepath.Join("/proc/driver/nvidia/gpus", id, "information"))
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "Device Minor:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			return n, err == nil
		}
	}
	return 0, false
}

// ParseMIGMinors reads the driver's mig-minors table ("gpu0/gi1/access 12"
// per line).
func ParseMIGMinors(r io.Reader) map[string]int {
	out := map[string]int{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			continue
		}
		if n, err := strconv.Atoi(f[1]); err == nil {
			out[f[0]] = n
		}
	}
	return out
}

// GenerateCDI describes machine m's GPUs as a CDI spec: per GPU its device
// node; per MIG instance its parent's node and its GPU and compute
// instances' capability nodes; for all, the control nodes and the
// driver's libraries and binaries (the spec's own edits). A MIG instance
// whose capability minors are unknown gets no CDI device, so a run of it
// fails to launch rather than seeing nothing, or its whole GPU.
func GenerateCDI(m device.Machine, h Host) (*cdispecs.Spec, error) {
	s := &cdispecs.Spec{Version: cdispecs.CurrentVersion, Kind: CDIKind}
	// A node is where the container sees it, /dev/<name>, read from
	// DevRoot/<name> on the host (a test's own nodes).
	node := func(name string) *cdispecs.DeviceNode {
		n := &cdispecs.DeviceNode{Path: "/dev/" + name}
		if root := cmpOr(h.DevRoot, "/dev"); root != "/dev" {
			n.HostPath = filepath.Join(root, name)
		}
		return n
	}
	var errs []error
	for _, g := range m.GPUs {
		d := cdispecs.Device{Name: g.UUID}
		minor, ok := h.Minors[g.UUID]
		if !ok {
			minor = g.Index
		}
		gpuNode := "nvidia" + strconv.Itoa(minor)
		if !h.Simulated {
			d.ContainerEdits.DeviceNodes = []*cdispecs.DeviceNode{node(gpuNode)}
		}
		s.Devices = append(s.Devices, d)
		for _, mi := range g.MIGInstances {
			if mi.UUID == "" {
				continue
			}
			md := cdispecs.Device{Name: mi.UUID}
			if !h.Simulated {
				gi := fmt.Sprintf("gpu%d/gi%d/access", minor, mi.GIID)
				ci := fmt.Sprintf("gpu%d/gi%d/ci%d/access", minor, mi.GIID, mi.CIID)
				giMinor, ok1 := h.MIGMinors[gi]
				ciMinor, ok2 := h.MIGMinors[ci]
				if !ok1 || !ok2 {
					errs = append(errs, fmt.Errorf("MIG instance %s of GPU %s: %w for %s or %s", mi.UUID, g.UUID, errUnknownMinor, gi, ci))
					continue
				}
				md.ContainerEdits.DeviceNodes = []*cdispecs.DeviceNode{
					node(gpuNode),
					node("nvidia-caps/nvidia-cap" + strconv.Itoa(giMinor)),
					node("nvidia-caps/nvidia-cap" + strconv.Itoa(ciMinor)),
				}
			}
			s.Devices = append(s.Devices, md)
		}
	}
	if !h.Simulated {
		for _, c := range h.ControlDevices {
			s.ContainerEdits.DeviceNodes = append(s.ContainerEdits.DeviceNodes, node(c))
		}
		for _, p := range slices.Concat(h.Libraries, h.Binaries) {
			s.ContainerEdits.Mounts = append(s.ContainerEdits.Mounts, &cdispecs.Mount{HostPath: p, ContainerPath: p,
				Options: []string{"ro", "nosuid", "nodev", "bind"}})
		}
	}
	return s, errors.Join(errs...)
}

// EditsFor gathers the edits of exactly devs from machine spec s: the
// spec's common edits and each device's own, device nodes once each. A
// device s does not describe is an error: the run must not start without
// the GPU it was given.
func EditsFor(s *cdispecs.Spec, devs []contracts.DeviceRef) (*cdispecs.ContainerEdits, error) {
	if s == nil {
		return nil, errors.New("this machine's GPUs have no CDI description")
	}
	out := &cdispecs.ContainerEdits{}
	seen := map[string]bool{}
	add := func(e cdispecs.ContainerEdits) {
		for _, n := range e.DeviceNodes {
			if !seen[n.Path] {
				seen[n.Path] = true
				c := *n
				out.DeviceNodes = append(out.DeviceNodes, &c)
			}
		}
		for _, m := range e.Mounts {
			c := *m
			out.Mounts = append(out.Mounts, &c)
		}
		out.Env = append(out.Env, e.Env...)
	}
	for _, d := range devs {
		name := d.VisibleUUID()
		i := slices.IndexFunc(s.Devices, func(cd cdispecs.Device) bool { return cd.Name == name })
		if i < 0 {
			return nil, fmt.Errorf("device %s (%s): no CDI device %s=%s on this machine", name, d.Model, CDIKind, name)
		}
		add(s.Devices[i].ContainerEdits)
	}
	if len(devs) > 0 {
		add(s.ContainerEdits)
	}
	return out, nil
}

// applyEdits applies e to s as CDI applies a device's edits: each device
// node is added with the device cgroup's permission for it (its type and
// numbers read from the host's node when the edit does not give them).
func applyEdits(s *specs.Spec, e *cdispecs.ContainerEdits) error {
	if len(e.DeviceNodes) == 0 && len(e.Mounts) == 0 && len(e.Env) == 0 {
		return nil
	}
	return (&cdi.ContainerEdits{ContainerEdits: e}).Apply(s)
}

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && !fi.IsDir()
}
