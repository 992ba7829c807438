package placement

import (
	"fmt"
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// gpus returns n free cards of model with mem MiB, in NVLink domain dom
// ("" for PCIe), the first busy of them held.
func gpus(node, model string, mem int64, n int, dom string, busy int) []GPU {
	out := make([]GPU, n)
	for i := range out {
		out[i] = GPU{Index: i, UUID: fmt.Sprintf("%s-g%d", node, i), Model: model, MemoryMiB: mem, NVLinkDomain: dom, Held: i < busy}
	}
	return out
}

const h100, a100 = "H100-80GB", "A100-80GB"

// mk is a node of pool with n H100s in one NVLink domain, busy held.
func mk(id, pool string, n, busy int) Node {
	return Node{ID: id, Pool: pool, CPUMilliFree: 64000, MemoryMiBFree: 512 << 10, GPUs: gpus(id, h100, 81920, n, id+"-nvl", busy)}
}

func whole(count int) Request { return Request{GPU: contracts.GPURequest{Count: count}} }

func share(mem int64, pct int) Request {
	return Request{GPU: contracts.GPURequest{Count: 1, Share: &contracts.GPUShare{MemoryMiB: mem, ComputePercent: pct}}}
}

func mig(profile string) Request {
	return Request{GPU: contracts.GPURequest{Count: 1, MIGProfile: profile}}
}

// placed renders a decision: "n1[0 1]", "n1[2 mig:1g.10gb@0]", or the code.
func placed(d Decision) string {
	if !d.Placed() {
		return string(d.Pending.Code)
	}
	var parts []string
	for _, pt := range d.Parts {
		var devs []string
		for _, dv := range pt.Devices {
			s := fmt.Sprint(dv.Index)
			switch {
			case dv.MIG != nil:
				s += fmt.Sprintf(":%s@%d", dv.MIG.Profile, dv.MIG.Start)
			case dv.Share != nil:
				s += fmt.Sprintf(":%d%%", dv.Share.ComputePercent)
			}
			devs = append(devs, s)
		}
		parts = append(parts, pt.NodeID+"["+strings.Join(devs, " ")+"]")
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// migGPU is an A100-80GB in MIG mode with the given instances (profile at
// start), held ones listed in held.
func migGPU(node string, index int, profiles []string, starts []int, held ...int) GPU {
	g := GPU{Index: index, UUID: fmt.Sprintf("%s-g%d", node, index), Model: a100, MemoryMiB: 81920, MIG: true}
	mem := map[string]int64{"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192, "7g.80gb": 80896}
	for i, pr := range profiles {
		g.Instances = append(g.Instances, MIGSlot{Instance: contracts.MIGInstance{UUID: fmt.Sprintf("MIG-%s-%d-%d", node, index, i),
			Profile: pr, GIID: i + 1, Start: starts[i], Size: 1, MemoryMiB: mem[pr]}, Held: slices.Contains(held, i)})
	}
	return g
}
