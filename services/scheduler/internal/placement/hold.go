package placement

import (
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// Hold is what backfill reservations of jobs ahead keep on one node: the
// devices (whole cards, MIG instances, shares) those jobs will take there,
// and the host CPU and memory the node has to spare once they run. A
// request whose Reserved names the node may use it, but only what the hold
// leaves: the held devices count as taken, and its CPU and memory must fit
// in the spare. Holding the devices rather than the machine keeps a
// reservation from idling what its job does not need (32 free 1g slices
// behind one reserved 7g job).
type Hold struct {
	// Devices are the held devices: a whole card (no MIG, no Share), a MIG
	// instance (MIG set) or a share of a card (Share set).
	Devices []contracts.DeviceRef
	// SpareCPUMilli and SpareMemoryMiB are the host capacity left on the
	// node once the holding jobs run; a job placed there must fit in them.
	SpareCPUMilli, SpareMemoryMiB int64
}

// Merge adds o to h: both holds' devices, the smaller spare.
func (h Hold) Merge(o Hold) Hold {
	return Hold{Devices: append(slices.Clip(h.Devices), o.Devices...),
		SpareCPUMilli: min(h.SpareCPUMilli, o.SpareCPUMilli), SpareMemoryMiB: min(h.SpareMemoryMiB, o.SpareMemoryMiB)}
}

// Apply marks h's devices held on n and caps n's free host capacity at
// h's spare. n's GPU slice is modified in place (pass a node whose GPUs
// are its own); MIG instance lists are copied before a slot is marked, so
// they may be shared with another node value.
func (h Hold) Apply(n *Node) {
	n.CPUMilliFree = min(n.CPUMilliFree, h.SpareCPUMilli)
	n.MemoryMiBFree = min(n.MemoryMiBFree, h.SpareMemoryMiB)
	for _, d := range h.Devices {
		i := slices.IndexFunc(n.GPUs, func(g GPU) bool { return sameCard(&g, d) })
		if i < 0 {
			continue
		}
		g := &n.GPUs[i]
		switch {
		case d.MIG != nil:
			k := slices.IndexFunc(g.Instances, func(s MIGSlot) bool { return sameInstance(s.Instance, *d.MIG) })
			if k >= 0 && !g.Instances[k].Held {
				g.Instances = slices.Clone(g.Instances)
				g.Instances[k].Held = true
			}
		case d.Share != nil:
			g.ShareMemMiB += d.Share.MemoryMiB
			g.SharePercent += d.Share.ComputePercent
		default:
			g.Held = true
		}
	}
}

// Held is a copy of n with h applied (n itself is not modified).
func (h Hold) Held(n *Node) Node {
	c := *n
	c.GPUs = slices.Clone(n.GPUs)
	h.Apply(&c)
	return c
}

func sameCard(g *GPU, d contracts.DeviceRef) bool {
	if d.UUID != "" && g.UUID != "" {
		return g.UUID == d.UUID
	}
	return g.Index == d.Index
}

func sameInstance(a, b contracts.MIGInstance) bool {
	if a.UUID != "" && b.UUID != "" {
		return a.UUID == b.UUID
	}
	return a.GIID == b.GIID && a.CIID == b.CIID
}

// placeHeld is the last resort of a one-machine request that found no
// node outside r.Reserved (or only one with an untolerated
// PreferNoSchedule taint): the held nodes, in node order, each as it
// stands now in this cycle with its hold applied (FitNode, so no policy:
// these are the holes a reservation leaves), those whose PreferNoSchedule
// taints r tolerates first, only those when tolerated. It takes the
// devices found and reports the part.
func (p *Placer) placeHeld(r *Request, tolerated bool) (Part, bool) {
	if len(r.Reserved) == 0 {
		return Part{}, false
	}
	fit := *r
	fit.AllowPool = nil // asked once per pool, through poolOK below
	ids := make([]string, 0, len(r.Reserved))
	for id := range r.Reserved {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	// Nodes whose PreferNoSchedule taints r tolerates first, as Place ranks.
	passes := 2
	if tolerated {
		passes = 1
	}
	for pass := range passes {
		for _, id := range ids {
			ord, ok := slices.BinarySearchFunc(p.nodes, id, func(n nodeState, id string) int {
				return strings.Compare(n.src.ID, id)
			})
			// Outside r's pool FitNode refuses the node anyway; asking the
			// pool's verdict would tell the caller of a quota r never needs
			// (and that a search skipped by the failure memo never asks).
			if !ok || (r.Pool != "" && p.nodes[ord].src.Pool != r.Pool) || !p.poolOK(r, p.nodes[ord].pool) {
				continue
			}
			n := p.current(int32(ord))
			if tolerated := contracts.Tolerated(r.Tolerations, n.Taints, contracts.TaintPreferNoSchedule); tolerated != (pass == 0) {
				continue
			}
			if devs, ok := FitNode(&n, fit); ok {
				return p.takeDevices(int32(ord), devs, r), true
			}
		}
	}
	return Part{}, false
}

// current is node ord as this cycle has left it: its snapshot node with
// the devices, MIG instances, shares and host capacity taken since.
func (p *Placer) current(ord int32) Node {
	ns := &p.nodes[ord]
	n := *ns.src
	n.CPUMilliFree, n.MemoryMiBFree = ns.cpu, ns.mem
	n.GPUs = slices.Clone(ns.src.GPUs)
	for i := range ns.slots {
		sl := &ns.slots[i]
		g := &n.GPUs[ns.gpu(i)]
		g.Held = sl.held
		g.ShareMemMiB, g.SharePercent = sl.mem, int(sl.pct)
		if g.MIG {
			g.Instances = slices.Clone(g.Instances)
			for j := range g.Instances {
				g.Instances[j].Held = j >= 64 || sl.migFree&(1<<j) == 0
			}
		}
	}
	return n
}

// takeDevices gives devs (found on node ord by FitNode) to r and updates
// the node's class, as take does for a policy's choice.
func (p *Placer) takeDevices(ord int32, devs []contracts.DeviceRef, r *Request) Part {
	n := &p.nodes[ord]
	for _, d := range devs {
		for i := range n.slots {
			g := &n.src.GPUs[n.gpu(i)]
			if !sameCard(g, d) {
				continue
			}
			sl := &n.slots[i]
			switch {
			case d.MIG != nil:
				if k := slices.IndexFunc(g.Instances, func(s MIGSlot) bool { return sameInstance(s.Instance, *d.MIG) }); k >= 0 && k < 64 {
					sl.migFree &^= 1 << k
				}
			case d.Share != nil:
				sl.mem += d.Share.MemoryMiB
				sl.pct += int32(d.Share.ComputePercent)
			default:
				sl.held = true
			}
			break
		}
	}
	n.cpu -= r.CPUMilli
	n.mem -= r.MemoryMiB
	p.move(ord)
	return Part{NodeID: n.src.ID, Pool: n.src.Pool, Zone: n.src.Zone, Devices: devs}
}
