package sim

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/catalog"
)

// dgx1Links is the NVLink hybrid cube-mesh of an 8×V100 SXM2 board
// (DGX-1V, as nvidia-smi topo -m shows it): every GPU uses its 6 links on
// 4 peers, two of them doubled (NV2), and has no NVLink to the other 3.
var dgx1Links = [8][8]int{
	{0, 1, 1, 2, 2, 0, 0, 0},
	{1, 0, 2, 1, 0, 2, 0, 0},
	{1, 2, 0, 2, 0, 0, 1, 0},
	{2, 1, 2, 0, 0, 0, 0, 1},
	{2, 0, 0, 0, 0, 1, 1, 2},
	{0, 2, 0, 0, 1, 0, 2, 1},
	{0, 0, 1, 0, 1, 2, 0, 2},
	{0, 0, 0, 1, 2, 1, 2, 0},
}

// Topology links every pair of a machine's GPUs (A < B), as nvidia-smi
// topo -m would show them.
//
// NVLink, on SXM boards (nvlink true):
//   - 8 V100: DGX-1's hybrid cube-mesh (dgx1Links);
//   - more than 4 GPUs otherwise: NVSwitch, every pair with all of a GPU's
//     links (NV18 between H100s, NV12 between A100s);
//   - up to 4 GPUs: a direct mesh, a GPU's links shared among its peers
//     (HGX A100 4-GPU: 4 per pair; HGX H100 4-GPU: 6; DGX Station V100: 2).
//
// On PCIe cards with NVLink bridges (bridges true), GPUs 2k and 2k+1 are
// joined with all their links; without, no pair has NVLink.
//
// PCIe paths: GPUs 2k and 2k+1 share a PCIe switch (PIX); machines of 4
// or more GPUs have two CPU sockets, the first half of the GPUs on the
// first: other pairs on one socket are NODE, across sockets SYS.
func Topology(model catalog.Model, count int, nvlink, bridges bool) []contracts.GPULink {
	if count < 2 {
		return nil
	}
	links := make([]contracts.GPULink, 0, count*(count-1)/2)
	for a := range count {
		for b := a + 1; b < count; b++ {
			l := contracts.GPULink{A: a, B: b, Path: pciePath(count, a, b)}
			switch {
			case nvlink && model.Architecture == "Volta" && count == 8:
				l.NVLinks = dgx1Links[a][b]
			case nvlink && count > 4:
				l.NVLinks = model.NVLinks
			case nvlink:
				l.NVLinks = model.NVLinks / (count - 1)
			case bridges && a/2 == b/2:
				l.NVLinks = model.NVLinks
			}
			links = append(links, l)
		}
	}
	return links
}

func pciePath(count, a, b int) contracts.TopoPath {
	switch {
	case a/2 == b/2:
		return contracts.TopoSingle
	case count < 4 || (a < count/2) == (b < count/2):
		return contracts.TopoNode
	default:
		return contracts.TopoSystem
	}
}

// nvlinkDomain is the NVLink domain of GPU i: the node for an SXM board,
// the bridged pair for PCIe cards with bridges, none otherwise.
func nvlinkDomain(node string, count, i int, nvlink, bridges bool) string {
	switch {
	case nvlink:
		return node
	case bridges && i^1 < count: // a lone last card has no partner
		return node + "-nvl" + strconv.Itoa(i/2)
	}
	return ""
}

// MIGUUID is the stable UUID of a simulated MIG device: "MIG-" and a
// UUID-shaped hex string from the node, the GPU index and the GPU
// instance ID, as nvidia-smi -L prints MIG devices.
func MIGUUID(nodeID string, index, giID int) string {
	sum := sha256.Sum256([]byte("gpuplane-sim-mig/" + nodeID + "/" + strconv.Itoa(index) + "/" + strconv.Itoa(giID)))
	return "MIG-" + uuidShape(sum[:16])
}

func uuidShape(b []byte) string {
	h := hex.EncodeToString(b)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// giID is the GPU instance ID the driver gives a placement: the IDs
// number the nodes of a binary tree over the 8 memory slices (0 the whole
// GPU, 1-2 the halves, 3-6 the quarters, 7-14 the eighths), which is how
// nvidia-smi mig -lgi numbers them on A100 and H100 (1g at 6:1 is GI 13,
// 2g at 4:2 is GI 5, 4g at 0:4 is GI 1).
func giID(start, size int) int {
	switch size {
	case 8:
		return 0
	case 4:
		return 1 + start/4
	case 2:
		return 3 + start/2
	default:
		return 7 + start
	}
}

// migInstances builds the MIG devices of GPU index from placements.
func migInstances(nodeID string, index int, model string, placements []contracts.MIGPlacement) []contracts.MIGInstance {
	out := make([]contracts.MIGInstance, 0, len(placements))
	for _, pl := range placements {
		p, err := contracts.LookupMIGProfile(model, pl.Profile)
		if err != nil {
			continue // PlaceMIG returned it: cannot happen
		}
		gi := giID(pl.Start, p.MemorySlices)
		out = append(out, contracts.MIGInstance{
			UUID: MIGUUID(nodeID, index, gi), Profile: p.Name, GIID: gi, CIID: 0,
			Start: pl.Start, Size: p.MemorySlices, MemoryMiB: p.MemoryMiB,
		})
	}
	return out
}
