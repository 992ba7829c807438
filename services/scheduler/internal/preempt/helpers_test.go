package preempt_test

import (
	"fmt"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/preempt"
)

// The test cluster: H100 nodes of whole cards, A100 nodes of MIG cards.
const (
	h100 = "H100-80GB"
	a100 = "A100-80GB"
	be   = contracts.PriorityBestEffort
	norm = contracts.PriorityNormal
	high = contracts.PriorityHigh
	crit = contracts.PriorityCritical
)

var t0 = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

func gpuUUID(node string, i int) string { return fmt.Sprintf("GPU-%s-%d", node, i) }
func migUUID(node string, i int) string { return fmt.Sprintf("MIG-%s-%d", node, i) }

type nodeOpt func(*placement.Node)

// node is an idle machine of n H100 cards in pool h100, zone z1.
func node(id string, n int, opts ...nodeOpt) placement.Node {
	nd := placement.Node{ID: id, Pool: "h100", Zone: "z1", CPUMilliFree: 64000, MemoryMiBFree: 512 << 10}
	for i := range n {
		nd.GPUs = append(nd.GPUs, placement.GPU{Index: i, UUID: gpuUUID(id, i), Model: h100, MemoryMiB: 81920})
	}
	for _, o := range opts {
		o(&nd)
	}
	return nd
}

// migNode is an idle machine with one A100 in MIG mode holding instances
// of the given profiles, in order.
func migNode(id string, profiles ...string) placement.Node {
	g := placement.GPU{Index: 0, UUID: gpuUUID(id, 0), Model: a100, MemoryMiB: 81920, MIG: true}
	for i, p := range profiles {
		g.Instances = append(g.Instances, placement.MIGSlot{Instance: contracts.MIGInstance{
			UUID: migUUID(id, i), Profile: p, GIID: i + 1, Start: i, Size: 1, MemoryMiB: 10240}})
	}
	return placement.Node{ID: id, Pool: "a100", Zone: "z1", CPUMilliFree: 64000, MemoryMiBFree: 512 << 10, GPUs: []placement.GPU{g}}
}

func zone(z string) nodeOpt   { return func(n *placement.Node) { n.Zone = z } }
func pool(p string) nodeOpt   { return func(n *placement.Node) { n.Pool = p } }
func cordoned() nodeOpt       { return func(n *placement.Node) { n.Cordoned = true } }
func cpuFree(m int64) nodeOpt { return func(n *placement.Node) { n.CPUMilliFree = m } }
func heldCard(i int) nodeOpt  { return func(n *placement.Node) { n.GPUs[i].Held = true } }
func nvlink(d ...string) nodeOpt { // domain of each card, in index order
	return func(n *placement.Node) {
		for i := range n.GPUs {
			n.GPUs[i].NVLinkDomain = d[i]
		}
	}
}

// reversed lists n's cards from the highest index down.
func reversed(n placement.Node) placement.Node {
	n.GPUs = slices.Clone(n.GPUs)
	slices.Reverse(n.GPUs)
	return n
}

// noUUIDs drops the cards' and MIG instances' UUIDs: devices are then
// matched by index, MIG instances by GPU and compute instance IDs.
func noUUIDs(n placement.Node) placement.Node {
	n.GPUs = slices.Clone(n.GPUs)
	for i := range n.GPUs {
		n.GPUs[i].UUID = ""
		n.GPUs[i].Instances = slices.Clone(n.GPUs[i].Instances)
		for j := range n.GPUs[i].Instances {
			n.GPUs[i].Instances[j].Instance.UUID = ""
		}
	}
	return n
}

type jobOpt func(*preempt.Running)

// job is an allocation of tenant "other" started two hours ago, holding
// what its options give it on nodeID. "other" has no guarantee: all it
// holds is borrowed (withinGuarantee says otherwise).
func job(id, nodeID string, pri contracts.Priority, opts ...jobOpt) preempt.Running {
	r := preempt.Running{AllocationID: id, Tenant: "other", JobID: id, NodeID: nodeID, Priority: pri, StartedAt: t0.Add(-2 * time.Hour),
		Borrowing: true}
	for _, o := range opts {
		o(&r)
	}
	return r
}

func cards(idx ...int) jobOpt {
	return func(r *preempt.Running) {
		for _, i := range idx {
			r.Devices = append(r.Devices, contracts.DeviceRef{Index: i, UUID: gpuUUID(r.NodeID, i), Model: h100})
		}
	}
}

func share(card int, memMiB int64, pct int) jobOpt {
	return func(r *preempt.Running) {
		r.Devices = append(r.Devices, contracts.DeviceRef{Index: card, UUID: gpuUUID(r.NodeID, card), Model: h100,
			Share: &contracts.GPUShare{MemoryMiB: memMiB, ComputePercent: pct}})
	}
}

func mig(slot int, profile string) jobOpt {
	return func(r *preempt.Running) {
		r.Devices = append(r.Devices, contracts.DeviceRef{Index: 0, UUID: gpuUUID(r.NodeID, 0), Model: a100,
			MIG: &contracts.MIGInstance{UUID: migUUID(r.NodeID, slot), Profile: profile, GIID: slot + 1, Start: slot, Size: 1, MemoryMiB: 10240}})
	}
}

func noDeviceUUIDs() jobOpt {
	return func(r *preempt.Running) {
		for i := range r.Devices {
			r.Devices[i].UUID = ""
			if r.Devices[i].MIG != nil {
				m := *r.Devices[i].MIG
				m.UUID = ""
				r.Devices[i].MIG = &m
			}
		}
	}
}
func started(ago time.Duration) jobOpt {
	return func(r *preempt.Running) { r.StartedAt = t0.Add(-ago) }
}
func notStarted() jobOpt { return func(r *preempt.Running) { r.StartedAt = time.Time{} } }
func checkpointed(ago time.Duration) jobOpt {
	return func(r *preempt.Running) { r.LastCheckpoint = t0.Add(-ago) }
}
func checkpointable() jobOpt  { return func(r *preempt.Running) { r.Checkpointable = true } }
func tenant(t string) jobOpt  { return func(r *preempt.Running) { r.Tenant = t } }
func borrowing() jobOpt       { return func(r *preempt.Running) { r.Borrowing = true } }
func withinGuarantee() jobOpt { return func(r *preempt.Running) { r.Borrowing = false } }
func inQuotaPool(p string) jobOpt {
	return func(r *preempt.Running) { r.Pool = p }
}
func gang(g string) jobOpt { return func(r *preempt.Running) { r.Gang = g; r.JobID = g } }
func host(cpu, mem int64) jobOpt {
	return func(r *preempt.Running) { r.CPUMilli, r.MemoryMiB = cpu, mem }
}

type reqOpt func(*preempt.Preemptor)

// wants is a preemptor of tenant "research" asking for count whole H100s.
func wants(pri contracts.Priority, count int, opts ...reqOpt) preempt.Preemptor {
	p := preempt.Preemptor{Priority: pri, Request: placement.Request{Tenant: "research",
		GPU: contracts.GPURequest{Count: count, Model: h100}}}
	for _, o := range opts {
		o(&p)
	}
	return p
}

func reclaim() reqOpt { return func(p *preempt.Preemptor) { p.Reclaim = true } }
func machines(n int, topo contracts.Topology) reqOpt {
	return func(p *preempt.Preemptor) { p.Request.GPU.Nodes, p.Request.GPU.Topology = n, topo }
}
func migOf(profile string) reqOpt {
	return func(p *preempt.Preemptor) {
		p.Request.GPU = contracts.GPURequest{Count: 1, Model: a100, MIGProfile: profile}
	}
}
func shareOf(memMiB int64, pct int) reqOpt {
	return func(p *preempt.Preemptor) {
		p.Request.GPU = contracts.GPURequest{Count: 1, Model: h100, Share: &contracts.GPUShare{MemoryMiB: memMiB, ComputePercent: pct}}
	}
}
func needsCPU(m int64) reqOpt { return func(p *preempt.Preemptor) { p.Request.CPUMilli = m } }
func inPool(pl string) reqOpt { return func(p *preempt.Preemptor) { p.Request.Pool = pl } }
func exclude(ids ...string) reqOpt {
	return func(p *preempt.Preemptor) {
		p.Request.Exclude = map[string]bool{}
		for _, id := range ids {
			p.Request.Exclude[id] = true
		}
	}
}
func topo(t contracts.Topology) reqOpt {
	return func(p *preempt.Preemptor) { p.Request.GPU.Topology = t }
}

// cluster is nodes with what running holds marked held, as the scheduler's
// snapshot would have it.
func cluster(nodes []placement.Node, running []preempt.Running) placement.Snapshot {
	nodes = cloneNodes(nodes)
	ord := map[string]int{}
	for i, n := range nodes {
		ord[n.ID] = i
	}
	for _, r := range running {
		i, ok := ord[r.NodeID]
		if !ok {
			continue
		}
		n := &nodes[i]
		n.CPUMilliFree -= r.CPUMilli
		n.MemoryMiBFree -= r.MemoryMiB
		for _, d := range r.Devices {
			g := &n.GPUs[slices.IndexFunc(n.GPUs, func(g placement.GPU) bool { return sameCard(g, d) })]
			switch {
			case d.MIG != nil:
				g.Instances[slices.IndexFunc(g.Instances, func(s placement.MIGSlot) bool { return sameSlot(s, d.MIG) })].Held = true
			case d.Share != nil:
				g.ShareMemMiB += d.Share.MemoryMiB
				g.SharePercent += d.Share.ComputePercent
			default:
				g.Held = true
			}
		}
	}
	return placement.Snapshot{Nodes: nodes}
}

func cloneNodes(nodes []placement.Node) []placement.Node {
	out := slices.Clone(nodes)
	for i := range out {
		out[i].GPUs = slices.Clone(out[i].GPUs)
		for j := range out[i].GPUs {
			out[i].GPUs[j].Instances = slices.Clone(out[i].GPUs[j].Instances)
		}
	}
	return out
}

// release is snap's node id with victims' holdings on it given back: the
// tests' own reading of "the victims are gone", independent of the
// package's.
func release(snap placement.Snapshot, id string, victims []preempt.Running) placement.Node {
	var mine []preempt.Running
	for _, v := range victims {
		if v.NodeID == id {
			mine = append(mine, v)
		}
	}
	i := slices.IndexFunc(snap.Nodes, func(n placement.Node) bool { return n.ID == id })
	n := cloneNodes(snap.Nodes[i : i+1])[0]
	n.CPUMilliFree, n.MemoryMiBFree = n.CPUMilliFree+sumCPU(mine), n.MemoryMiBFree+sumMem(mine)
	for _, v := range mine {
		for _, d := range v.Devices {
			g := &n.GPUs[slices.IndexFunc(n.GPUs, func(g placement.GPU) bool { return sameCard(g, d) })]
			switch {
			case d.MIG != nil:
				g.Instances[slices.IndexFunc(g.Instances, func(s placement.MIGSlot) bool { return sameSlot(s, d.MIG) })].Held = false
			case d.Share != nil:
				g.ShareMemMiB -= d.Share.MemoryMiB
				g.SharePercent -= d.Share.ComputePercent
			default:
				g.Held = false
			}
		}
	}
	return n
}

// sameCard and sameSlot match by UUID, or by index and instance IDs
// where there is none.
func sameCard(g placement.GPU, d contracts.DeviceRef) bool {
	if g.UUID != "" && d.UUID != "" {
		return g.UUID == d.UUID
	}
	return g.Index == d.Index
}

func sameSlot(s placement.MIGSlot, m *contracts.MIGInstance) bool {
	if s.Instance.UUID != "" && m.UUID != "" {
		return s.Instance.UUID == m.UUID
	}
	return s.Instance.GIID == m.GIID && s.Instance.CIID == m.CIID
}

func sumCPU(rs []preempt.Running) (s int64) {
	for _, r := range rs {
		s += r.CPUMilli
	}
	return s
}

func sumMem(rs []preempt.Running) (s int64) {
	for _, r := range rs {
		s += r.MemoryMiB
	}
	return s
}

// perMachine is the request FitNode checks on each of p's machines.
func perMachine(p preempt.Preemptor) placement.Request {
	r := p.Request
	r.GPU.Count /= r.Machines()
	r.GPU.Nodes = 1
	if r.GPU.Topology == contracts.TopologyZone {
		r.GPU.Topology = contracts.TopologyAny
	}
	return r
}
