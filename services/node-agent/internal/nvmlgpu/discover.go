package nvmlgpu

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/device"
)

const mib = 1 << 20

// Discover reads the GPUs, the driver and the topology. Fields a GPU does
// not report stay empty; only a failure of the driver itself fails it.
func (b *Backend) Discover(ctx context.Context) (device.Machine, error) {
	if err := b.enter(); err != nil {
		return device.Machine{}, err
	}
	defer b.leave()
	var m device.Machine
	driver, ret := b.lib.SystemGetDriverVersion()
	if ret != nvml.SUCCESS {
		return m, fmt.Errorf("nvml backend: driver version: %w", ret)
	}
	m.DriverVersion = driver
	if v, ret := b.lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS {
		m.CUDAVersion = cudaVersion(v)
	}
	for _, g := range b.gpus {
		if err := ctx.Err(); err != nil {
			return device.Machine{}, err
		}
		m.GPUs = append(m.GPUs, b.info(g))
	}
	var joined [][2]int
	m.Topology, joined = b.topology()
	for i, domain := range nvlinkDomains(b.nodeID, len(b.gpus), joined) {
		m.GPUs[i].NVLinkDomain = domain
	}
	return m, nil
}

// cudaVersion writes NVML's 12040 as "12.4".
func cudaVersion(v int) string { return fmt.Sprintf("%d.%d", v/1000, v%1000/10) }

func (b *Backend) info(g *gpu) contracts.GPUInfo {
	info := contracts.GPUInfo{Index: g.index, UUID: g.uuid, Model: g.model}
	var totalBytes uint64
	if mem, ret := g.dev.GetMemoryInfo(); b.read(g, "memory", ret) {
		totalBytes = mem.Total
		info.MemoryMiB = int64(mem.Total / mib)
	}
	if pci, ret := g.dev.GetPciInfo(); b.read(g, "pci", ret) {
		info.PCIBusID = cString(pci.BusId[:])
	}
	if major, minor, ret := g.dev.GetCudaComputeCapability(); b.read(g, "compute_capability", ret) {
		info.ComputeCapability = fmt.Sprintf("%d.%d", major, minor)
	}
	info.MIGEnabled, info.MIGInstances = b.migInstances(g, totalBytes)
	b.mu.Lock()
	info.Healthy = g.healthy
	b.mu.Unlock()
	return info
}

// migInstances reads g's MIG mode and the MIG devices that exist now.
func (b *Backend) migInstances(g *gpu, totalBytes uint64) (bool, []contracts.MIGInstance) {
	current, _, ret := g.dev.GetMigMode()
	if !b.read(g, "mig_mode", ret) || current != nvml.DEVICE_MIG_ENABLE {
		return false, nil
	}
	n, ret := g.dev.GetMaxMigDeviceCount()
	if !b.read(g, "mig_device_count", ret) {
		return true, nil
	}
	var out []contracts.MIGInstance
	for i := range n {
		mig, ret := g.dev.GetMigDeviceHandleByIndex(i)
		if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue // no MIG device at this index
		}
		if !b.read(g, "mig_device", ret) {
			continue
		}
		if inst, ok := b.migInstance(g, mig, totalBytes); ok {
			out = append(out, inst)
		}
	}
	slices.SortFunc(out, func(a, b contracts.MIGInstance) int {
		return cmp.Or(cmp.Compare(a.GIID, b.GIID), cmp.Compare(a.CIID, b.CIID))
	})
	return true, out
}

// migInstance reads one MIG device. Its profile comes from its GPU
// instance's profile (which also gives the placement); where the driver
// does not let us read GPU instances (they may need privileges), from the
// MIG device's own attributes, without a placement.
func (b *Backend) migInstance(g *gpu, mig nvml.Device, totalBytes uint64) (contracts.MIGInstance, bool) {
	uuid, ret := mig.GetUUID()
	if !b.read(g, "mig_uuid", ret) {
		return contracts.MIGInstance{}, false
	}
	inst := contracts.MIGInstance{UUID: uuid}
	giID, ret := mig.GetGpuInstanceId()
	if !b.read(g, "mig_gpu_instance_id", ret) {
		return contracts.MIGInstance{}, false
	}
	ciID, ret := mig.GetComputeInstanceId()
	if !b.read(g, "mig_compute_instance_id", ret) {
		return contracts.MIGInstance{}, false
	}
	inst.GIID, inst.CIID = giID, ciID
	if mem, ret := mig.GetMemoryInfo(); b.read(g, "mig_memory", ret) {
		inst.MemoryMiB = int64(mem.Total / mib)
	}
	var giSlices, ciSlices uint32
	var memMB uint64
	if gi, ret := g.dev.GetGpuInstanceById(giID); ret == nvml.SUCCESS {
		if info, ret := gi.GetInfo(); ret == nvml.SUCCESS {
			inst.Start, inst.Size = int(info.Placement.Start), int(info.Placement.Size)
			if p, ok := gpuInstanceProfile(g.dev, info.ProfileId); ok {
				giSlices, ciSlices, memMB = p.SliceCount, p.SliceCount, p.MemorySizeMB
				if s, ok := computeInstanceSlices(gi, ciID); ok {
					ciSlices = s
				}
			}
		}
	}
	if giSlices == 0 {
		if a, ret := mig.GetAttributes(); b.read(g, "mig_attributes", ret) {
			giSlices, ciSlices, memMB = a.GpuInstanceSliceCount, a.ComputeInstanceSliceCount, a.MemorySizeMB
		}
	}
	if giSlices > 0 {
		inst.Profile = migProfileName(ciSlices, giSlices, memMB, totalBytes)
	}
	if inst.MemoryMiB == 0 {
		inst.MemoryMiB = int64(memMB)
	}
	return inst, true
}

// gpuInstanceProfile finds the GPU instance profile whose ID is id (NVML
// lists profiles by index, and IDs differ from indexes).
func gpuInstanceProfile(dev nvml.Device, id uint32) (nvml.GpuInstanceProfileInfo, bool) {
	for i := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		p, ret := dev.GetGpuInstanceProfileInfo(i)
		if ret == nvml.SUCCESS && p.Id == id {
			return p, true
		}
	}
	return nvml.GpuInstanceProfileInfo{}, false
}

// computeInstanceSlices is the slice count of compute instance ciID of gi.
func computeInstanceSlices(gi nvml.GpuInstance, ciID int) (uint32, bool) {
	ci, ret := gi.GetComputeInstanceById(ciID)
	if ret != nvml.SUCCESS {
		return 0, false
	}
	info, ret := ci.GetInfo()
	if ret != nvml.SUCCESS {
		return 0, false
	}
	for i := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		p, ret := gi.GetComputeInstanceProfileInfo(i, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret == nvml.SUCCESS && p.Id == info.ProfileId {
			return p.SliceCount, true
		}
	}
	return 0, false
}

// migProfileName names a MIG profile as nvidia-smi does: "3g.40gb", or
// "1c.3g.40gb" for a compute instance smaller than its GPU instance. The
// memory figure is NVIDIA's rounding (the one of go-nvlib and the device
// plugin): the instance's fraction of the GPU's memory, rounded up to an
// eighth, times the GPU's size in whole GB.
func migProfileName(ciSlices, giSlices uint32, memMB, totalBytes uint64) string {
	gb := memMB / 1024
	if totalBytes > 0 {
		const gib = 1 << 30
		frac := float64(memMB) * mib / float64(totalBytes)
		frac = math.Ceil(frac*8) / 8
		gb = uint64(math.Round(frac * float64((totalBytes+gib-1)/gib)))
	}
	name := fmt.Sprintf("%dg.%dgb", giSlices, gb)
	if ciSlices > 0 && ciSlices < giSlices {
		name = fmt.Sprintf("%dc.%s", ciSlices, name)
	}
	return name
}

var topoPaths = map[nvml.GpuTopologyLevel]contracts.TopoPath{
	nvml.TOPOLOGY_INTERNAL:   contracts.TopoInternal,
	nvml.TOPOLOGY_SINGLE:     contracts.TopoSingle,
	nvml.TOPOLOGY_MULTIPLE:   contracts.TopoMultiple,
	nvml.TOPOLOGY_HOSTBRIDGE: contracts.TopoHostBridge,
	nvml.TOPOLOGY_NODE:       contracts.TopoNode,
	nvml.TOPOLOGY_SYSTEM:     contracts.TopoSystem,
}

// topology links every pair of GPUs: the PCIe common ancestor and the
// active NVLink links. A link whose remote end is another GPU of this
// machine joins that pair directly; one whose remote end is not a GPU is
// an NVSwitch port, and GPUs on switches reach each other with as many
// links as the less connected of the two has (nvidia-smi's NV18 on an
// HGX H100). joined lists the pairs (by position in b.gpus) with NVLink.
func (b *Backend) topology() (links []contracts.GPULink, joined [][2]int) {
	byBus := map[string]int{}
	for i, g := range b.gpus {
		if g.busID != "" {
			byBus[g.busID] = i
		}
	}
	direct := map[[2]int]int{}
	switched := make([]int, len(b.gpus))
	for i, g := range b.gpus {
		for link := range nvml.NVLINK_MAX_LINKS {
			state, ret := g.dev.GetNvLinkState(link)
			if ret != nvml.SUCCESS || state != nvml.FEATURE_ENABLED {
				continue // no such link, NVLink not supported, or link down
			}
			remote, ret := g.dev.GetNvLinkRemotePciInfo(link)
			if ret != nvml.SUCCESS {
				continue
			}
			if j, ok := byBus[normalBusID(cString(remote.BusId[:]))]; ok && j != i {
				direct[[2]int{i, j}]++
			} else if !ok {
				switched[i]++
			}
		}
	}
	for i := range b.gpus {
		for j := i + 1; j < len(b.gpus); j++ {
			l := contracts.GPULink{A: b.gpus[i].index, B: b.gpus[j].index}
			if level, ret := b.gpus[i].dev.GetTopologyCommonAncestor(b.gpus[j].dev); ret == nvml.SUCCESS {
				l.Path = topoPaths[level]
			}
			// A direct link is seen from both ends; either end suffices.
			l.NVLinks = max(direct[[2]int{i, j}], direct[[2]int{j, i}]) + min(switched[i], switched[j])
			if l.NVLinks > 0 {
				joined = append(joined, [2]int{i, j})
			}
			links = append(links, l)
		}
	}
	return links, joined
}

// nvlinkDomains gives each of n GPUs (by position) its NVLink domain: GPUs
// joined by NVLink, directly or through others, share "<node>-nvl<k>",
// numbered from the lowest GPU; a GPU without NVLink has none. joined
// lists the pairs (by position) with at least one active link.
func nvlinkDomains(node string, n int, joined [][2]int) []string {
	parent := make([]int, n)
	for i := range parent {
		parent[i] = i
	}
	var find func(int) int
	find = func(i int) int {
		if parent[i] != i {
			parent[i] = find(parent[i])
		}
		return parent[i]
	}
	linked := make([]bool, n)
	for _, p := range joined {
		linked[p[0]], linked[p[1]] = true, true
		ra, rb := find(p[0]), find(p[1])
		parent[max(ra, rb)] = min(ra, rb)
	}
	out := make([]string, n)
	names := map[int]string{}
	for i := range n {
		if !linked[i] {
			continue
		}
		r := find(i)
		if _, ok := names[r]; !ok {
			names[r] = fmt.Sprintf("%s-nvl%d", node, len(names))
		}
		out[i] = names[r]
	}
	return out
}
