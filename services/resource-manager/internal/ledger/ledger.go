// Package ledger is the resource manager's pure model of the allocation
// ledger: for every node, the devices its inventory declares, which
// allocation holds each device (a whole GPU, a MIG instance, or a share of
// a GPU's memory and compute), and the last ledger stream sequence applied
// for that node (the value a commit's compare-and-set expects).
//
// The ledger never touches the network. It is fed in stream order with
// Apply (entries read from gp.alloc.ledger.<node> or just published there),
// SetInventory and SetReady, and asked with Verify whether a plan item can
// be committed now. A Ledger is not safe for concurrent use; its owner
// serializes calls.
//
// Apply is idempotent: an entry at or below a node's last applied sequence
// changes nothing, a committed allocation ID already present is a no-op and
// a release of an allocation that is not live is a no-op. Verify is O(devices
// of the item × claims on their GPUs, at most 100 shares each, plus the
// live parts of the item's job); nothing here is O(total allocations).
//
// Besides devices, the ledger accounts each node's host CPU and memory
// (Allocation.CPUMilli and MemoryMiB against the inventory's), and keeps
// the cordon and drain holds on nodes and single GPUs (SetAdmin): a held
// node or GPU takes no new allocation. A multi-machine job holds one allocation per machine
// (contracts.AllocationPartID, Allocation.Gang), each verified and
// committed on its own node like any other.
package ledger

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/recset"
)

// ErrConflict is returned (wrapped) by Apply when the log itself commits a
// device that another live allocation holds: a G1 violation written by some
// other writer. The entry is still recorded (the log is the truth) and the
// device stays held until every claimant is released.
var ErrConflict = errors.New("ledger: device committed twice")

// ErrInvalidEntry is returned (wrapped) by Apply for an entry it cannot
// place (no node, no allocation ID, unknown kind). Nothing changes; the
// caller still owes the node an Advance so its sequence keeps up with the
// subject.
var ErrInvalidEntry = errors.New("ledger: invalid entry")

// Verdict is Verify's answer for one plan item.
type Verdict struct {
	// Reason is a contracts.Refused* code, "" when the item is not refused.
	Reason contracts.Reason
	// Message says why, for people.
	Message string
	// Duplicate: the identical allocation is already in the ledger
	// (committed, possibly released since); committing it again is a
	// no-op, not a refusal.
	Duplicate bool
}

// OK reports whether the item can be committed now.
func (v Verdict) OK() bool { return v.Reason == "" && !v.Duplicate }

// Refused reports whether the item must be refused.
func (v Verdict) Refused() bool { return v.Reason != "" }

func refuse(r contracts.Reason, format string, args ...any) Verdict {
	return Verdict{Reason: r, Message: fmt.Sprintf(format, args...)}
}

// node is the ledger's state of one node.
//
// What each live allocation holds is kept in four claim maps. Each lists
// the live allocations claiming a thing in commit order; more than one
// allocation in a whole or mig list only happens after an ErrConflict (the
// log is the truth, and the device stays held until every claimant is
// released), so the first one is "the holder".
type node struct {
	id string
	// idx is the node's index in Ledger.nodeIDs.
	idx uint32
	// hasInventory: an inventory was seen; devices is its GPUs by UUID.
	hasInventory bool
	devices      map[string]contracts.GPUInfo
	// migInvalid maps a GPU UUID to why its reported MIG state breaks the
	// model's placement rules; such a GPU takes no new allocation.
	migInvalid map[string]error
	// ready: registered and not lost (the liveness side's verdict).
	ready bool
	// admin is the hold on the node (cordon, drain) and on single GPUs of
	// it, by administrators or the platform; the zero value is none.
	admin contracts.NodeAdmin
	// cpuCap and memCap are the host's CPU (milli) and memory (MiB) the
	// latest inventory declares; 0 means unknown (not checked).
	cpuCap, memCap int64
	// cpuUsed and memUsed are what the live allocations hold of them.
	cpuUsed, memUsed int64
	// whole: GPU UUID -> allocations holding the GPU whole.
	whole map[string][]string
	// mig: MIG instance UUID -> allocations holding the instance.
	mig map[string][]string
	// migOn: GPU UUID -> one allocation ID per MIG instance claim on it,
	// so that a whole GPU or a share is refused while any is held.
	migOn map[string][]string
	// shares: GPU UUID -> the shares held on it.
	shares map[string][]shareClaim
	// live is the set of live allocation IDs on the node.
	live map[string]struct{}
	// lastSeq is the stream sequence of the last ledger entry applied
	// from this node's subject.
	lastSeq uint64
}

// shareClaim is one allocation's share of a GPU.
type shareClaim struct {
	id    string
	share contracts.GPUShare
}

// claimKind is what a DeviceRef asks of its GPU.
type claimKind int

const (
	claimWhole claimKind = iota // the whole GPU
	claimMIG                    // one MIG instance of it
	claimShare                  // a share of it
)

// kindOf classifies d. A ref with both MIG and Share set is refused by
// Verify; should the log hold one anyway, commit and release classify it
// the same way, so a release frees exactly what its commit claimed.
func kindOf(d contracts.DeviceRef) claimKind {
	switch {
	case d.MIG != nil:
		return claimMIG
	case d.Share != nil:
		return claimShare
	default:
		return claimWhole
	}
}

// record is what the ledger keeps of one live allocation. Once released
// it is retired (retire.go): only a fixed-size record stays.
type record struct {
	alloc contracts.Allocation
	// order is the allocation's place in commit order: a snapshot lists
	// the live allocations in it, so that claims rebuilt from one are in
	// the order the log made them (the first claimant is the holder).
	order uint64
}

// Ledger is the allocation ledger of every node. The zero value is not
// usable; call New.
type Ledger struct {
	nodes map[string]*node
	// allocs are the live allocations by ID; retired the allocation IDs
	// released (or whose release came first): their RetiredRecordSize
	// records keyed by the ID's hash, in retirement order, append-only, so
	// that Export hands out views of them without copying (a snapshot is
	// taken under the owner's lock) (retire.go).
	allocs  map[string]*record
	retired *recset.Window
	// nodeIDs names each node by its index (node.idx), for retired
	// records; commits counts commits, for record.order.
	nodeIDs []string
	commits uint64
	// liveJobs maps tenant/job to the job's live allocation IDs, in
	// commit order: a job holds one live allocation (J1), or the parts of
	// one multi-machine attempt, one per machine.
	liveJobs map[string][]string
}

// New returns an empty ledger that keeps retired records for keep of log
// time after their release (Keep).
func New(keep time.Duration) *Ledger {
	return &Ledger{nodes: map[string]*node{}, allocs: map[string]*record{}, retired: recset.NewWindow(RetiredRecordSize, keep),
		liveJobs: map[string][]string{}}
}

func (l *Ledger) node(id string) *node {
	n, ok := l.nodes[id]
	if !ok {
		n = &node{id: id, idx: uint32(len(l.nodeIDs)), devices: map[string]contracts.GPUInfo{}, migInvalid: map[string]error{},
			whole: map[string][]string{}, mig: map[string][]string{}, migOn: map[string][]string{},
			shares: map[string][]shareClaim{}, live: map[string]struct{}{}}
		l.nodes[id] = n
		l.nodeIDs = append(l.nodeIDs, id)
	}
	return n
}

// SetInventory replaces the devices of inv.NodeID with inv.GPUs (the latest
// inventory wins). Allocations holding devices the new inventory no longer
// lists keep them until released.
//
// MIG instances exist physically (an administrator made them), so their
// placement is the inventory's to report; still, a GPU whose reported MIG
// state breaks the model's placement rules is not trusted: the inventory
// is recorded, the GPU takes no new allocation (mig_inventory_invalid)
// until a consistent inventory arrives, and the returned error names every
// such GPU and problem, for the caller to log.
func (l *Ledger) SetInventory(inv contracts.NodeInventory) error {
	n := l.node(inv.NodeID)
	n.hasInventory = true
	n.cpuCap, n.memCap = max(inv.CPUMilli, 0), max(inv.MemoryMiB, 0)
	n.devices = make(map[string]contracts.GPUInfo, len(inv.GPUs))
	n.migInvalid = map[string]error{}
	seen := map[string]string{} // MIG UUID -> GPU UUID, across the node
	var errs []error
	for _, g := range inv.GPUs {
		n.devices[g.UUID] = g
		if err := checkMIG(g, seen); err != nil {
			n.migInvalid[g.UUID] = err
			errs = append(errs, fmt.Errorf("GPU %s (index %d): %w", g.UUID, g.Index, err))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("node %s: inconsistent MIG inventory, GPUs left unusable: %w", inv.NodeID, errors.Join(errs...))
	}
	return nil
}

// checkMIG checks a GPU's reported MIG state: instances only in MIG mode,
// each with a UUID unique on the node (seen) and the size its profile
// has, together a valid set of placements for the model.
func checkMIG(g contracts.GPUInfo, seen map[string]string) error {
	if !g.MIGEnabled {
		if len(g.MIGInstances) > 0 {
			return fmt.Errorf("MIG mode is off, yet %d MIG instances are listed", len(g.MIGInstances))
		}
		return nil
	}
	var errs []error
	ps := make([]contracts.MIGPlacement, 0, len(g.MIGInstances))
	for i, m := range g.MIGInstances {
		switch other, dup := seen[m.UUID]; {
		case m.UUID == "":
			errs = append(errs, fmt.Errorf("MIG instance %d has no UUID", i))
		case dup:
			errs = append(errs, fmt.Errorf("MIG instance %s is also listed on GPU %s", m.UUID, other))
		default:
			seen[m.UUID] = g.UUID
		}
		if p, err := contracts.LookupMIGProfile(g.Model, m.Profile); err == nil && m.Size != p.MemorySlices {
			errs = append(errs, fmt.Errorf("MIG instance %s: size %d, but profile %s spans %d memory slices",
				m.UUID, m.Size, m.Profile, p.MemorySlices))
		}
		ps = append(ps, m.Placement())
	}
	if err := contracts.ValidateMIGPlacements(g.Model, ps); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// SetReady records whether a node may receive new allocations (registered
// and not lost).
func (l *Ledger) SetReady(nodeID string, ready bool) { l.node(nodeID).ready = ready }

// SetAdmin records the administrators' hold on a node (the latest value of
// its key in contracts.BucketNodeAdmin; the zero NodeAdmin when the key is
// deleted). A node cordoned or draining takes no new allocation, nor does
// a GPU it holds (a.Held); what they hold stays held until released.
func (l *Ledger) SetAdmin(nodeID string, a contracts.NodeAdmin) { l.node(nodeID).admin = a }

// HostUsed returns the host CPU (milli) and memory (MiB) the live
// allocations of a node hold.
func (l *Ledger) HostUsed(nodeID string) (cpuMilli, memoryMiB int64) {
	if n, ok := l.nodes[nodeID]; ok {
		return n.cpuUsed, n.memUsed
	}
	return 0, 0
}

// LastSeq is the stream sequence of the last entry applied for nodeID, 0
// when none: the expected last subject sequence of the next commit there.
func (l *Ledger) LastSeq(nodeID string) uint64 {
	if n, ok := l.nodes[nodeID]; ok {
		return n.lastSeq
	}
	return 0
}

// Advance records that the node's subject reached seq with a message that
// changes nothing (an entry Apply refused as invalid), so the next
// compare-and-set expects the right sequence.
func (l *Ledger) Advance(nodeID string, seq uint64) {
	n := l.node(nodeID)
	n.lastSeq = max(n.lastSeq, seq)
}

// Allocation returns the allocation with that ID and whether it is live;
// ok is false when the ledger never saw it committed.
//
// Of an allocation no longer live only its ID and node are kept (a
// retired record): that is all a run fact or a release of it asks.
func (l *Ledger) Allocation(id string) (a contracts.Allocation, live, ok bool) {
	if r, ok := l.allocs[id]; ok {
		return r.alloc, true, true
	}
	if r, ok := l.retiredOf(retiredKeyOf(id)); ok {
		return contracts.Allocation{ID: id, NodeID: l.nodeIDs[r.node]}, false, true
	}
	return contracts.Allocation{}, false, false
}

// Live returns the live allocations of a node, sorted by ID.
func (l *Ledger) Live(nodeID string) []contracts.Allocation {
	n, ok := l.nodes[nodeID]
	if !ok {
		return nil
	}
	out := make([]contracts.Allocation, 0, len(n.live))
	for id := range n.live {
		out = append(out, l.allocs[id].alloc)
	}
	slices.SortFunc(out, func(a, b contracts.Allocation) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// LiveCount is the number of live allocations on a node.
func (l *Ledger) LiveCount(nodeID string) int {
	if n, ok := l.nodes[nodeID]; ok {
		return len(n.live)
	}
	return 0
}

// Holder returns the live allocation holding, exclusively, a GPU (by its
// UUID) or a MIG instance (by the instance's UUID) of a node; "" when it
// is free or only shared (see Shared).
func (l *Ledger) Holder(nodeID, uuid string) string {
	n, ok := l.nodes[nodeID]
	if !ok {
		return ""
	}
	if h := n.whole[uuid]; len(h) > 0 {
		return h[0]
	}
	if h := n.mig[uuid]; len(h) > 0 {
		return h[0]
	}
	return ""
}

// Shared returns the sum of the shares held on a GPU of a node and the
// allocations holding them, in commit order; zero and nil when none.
func (l *Ledger) Shared(nodeID, gpuUUID string) (used contracts.GPUShare, holders []string) {
	n, ok := l.nodes[nodeID]
	if !ok {
		return contracts.GPUShare{}, nil
	}
	for _, c := range n.shares[gpuUUID] {
		holders = append(holders, c.id)
	}
	return sumShares(n.shares[gpuUUID]), holders
}

// Nodes returns the IDs of every node the ledger knows, sorted.
func (l *Ledger) Nodes() []string {
	out := make([]string, 0, len(l.nodes))
	for id := range l.nodes {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

// Verify checks a plan item against the ledger. The checks, in the order
// their reasons win:
//
//  1. invalid_plan: the item is malformed (its ID is not AllocationID of
//     its tenant, job and attempt, a token is invalid, no devices, a device
//     twice, a bad MIG or share ref). A device is a whole GPU, one MIG
//     instance of a GPU, or a share of a GPU; an item names a GPU once,
//     except for distinct MIG instances of it.
//  2. the allocation ID is already in the ledger: Duplicate when it is the
//     identical allocation (same node, same devices), else
//     job_already_allocated; also job_already_allocated when another
//     attempt of the job is live.
//  3. unknown_node: no inventory for the node; node_not_ready: not
//     registered, or lost; node_cordoned: an administrator cordoned or
//     is draining it.
//  4. per device, in item order: unknown_device: a UUID the inventory does
//     not list, or listed at another index; gpu_model_mismatch: the model
//     differs; device_unhealthy; mig_inventory_invalid: the GPU's reported
//     MIG state is inconsistent; mig_disabled: a MIG instance of a GPU not
//     in MIG mode; node_cordoned: the GPU is held (NodeAdmin.GPUs; a MIG
//     instance or a share by its parent GPU); mig_enabled: a whole GPU or a share of a GPU in MIG mode
//     (its capacity is its instances); mig_instance_unknown: the GPU has no
//     such instance, or not with that profile and placement.
//  5. per device, in item order, against the live allocations:
//     device_taken: the GPU is held whole (or, for a share, by a MIG
//     instance; for a MIG instance, by a share), gpu_shared: a whole GPU
//     of which a share or a MIG instance is held, mig_instance_taken,
//     share_exceeds_gpu: the shares held plus this one pass the GPU's
//     memory or 100% of its compute.
//  6. host_capacity: the item's CPU or memory passes what the inventory
//     declares less what the live allocations hold (a request of 0, or an
//     inventory that declares 0, is not checked).
//
// A part of a multi-machine job (Gang set) is checked like any other item
// on its own node; the parts of one attempt may be live together (J1 holds
// per attempt), and all-or-nothing is the scheduler's: it releases the
// parts that were committed when one is refused.
func (l *Ledger) Verify(a contracts.Allocation) Verdict {
	if v := validate(a); v.Refused() {
		return v
	}
	if r, ok := l.allocs[a.ID]; ok {
		if samePlacement(r.alloc, a) {
			return Verdict{Duplicate: true, Message: "allocation already committed"}
		}
		return refuse(contracts.RefusedAlreadyPlaced, "allocation %s is already committed on node %s", a.ID, r.alloc.NodeID)
	}
	if r, ok := l.retiredOf(retiredKeyOf(a.ID)); ok {
		// Released since: the same answer as when it was live.
		if r.place == placementHash(a) {
			return Verdict{Duplicate: true, Message: "allocation already committed"}
		}
		return refuse(contracts.RefusedAlreadyPlaced, "allocation %s is already committed on node %s", a.ID, l.nodeIDs[r.node])
	}
	for _, other := range l.liveJobs[jobKey(a)] {
		if o := l.allocs[other].alloc; !sameGang(o, a) {
			return refuse(contracts.RefusedAlreadyPlaced, "job %s/%s already holds live allocation %s", a.Tenant, a.JobID, other)
		}
	}
	n, ok := l.nodes[a.NodeID]
	if !ok || !n.hasInventory {
		return refuse(contracts.RefusedUnknownNode, "node %s has no inventory", a.NodeID)
	}
	if !n.ready {
		return refuse(contracts.RefusedNodeNotReady, "node %s is not registered or is lost", a.NodeID)
	}
	if v := n.checkAdmin(); v.Refused() {
		return v
	}
	for _, d := range a.Devices {
		g, ok := n.devices[d.UUID]
		switch {
		case !ok:
			return refuse(contracts.RefusedUnknownDevice, "node %s has no GPU %s", a.NodeID, d.UUID)
		case g.Index != d.Index:
			return refuse(contracts.RefusedUnknownDevice, "GPU %s is index %d on node %s, not %d", d.UUID, g.Index, a.NodeID, d.Index)
		case g.Model != d.Model:
			return refuse(contracts.RefusedModelMismatch, "GPU %s on node %s is %s, not %s", d.UUID, a.NodeID, g.Model, d.Model)
		case !g.Healthy:
			// The agent reported a fault (XID, double-bit ECC, fell off
			// the bus) after the scheduler's snapshot: new work stays off
			// the GPU until the agent reports it recovered.
			return refuse(contracts.RefusedDeviceUnhealthy, "GPU %s on node %s is unhealthy", d.UUID, a.NodeID)
		}
		if v := n.checkGPUHold(d); v.Refused() {
			return v
		}
		if v := n.checkMode(d, g); v.Refused() {
			return v
		}
	}
	for _, d := range a.Devices {
		if v := n.checkFree(d); v.Refused() {
			return v
		}
	}
	return n.checkHost(a)
}

// OtherAttemptNodes returns the nodes of the job's live allocations that
// make Verify refuse a as job_already_allocated (those not of a's gang),
// each once.
func (l *Ledger) OtherAttemptNodes(a contracts.Allocation) []string {
	var nodes []string
	for _, other := range l.liveJobs[jobKey(a)] {
		if o := l.allocs[other].alloc; !sameGang(o, a) && !slices.Contains(nodes, o.NodeID) {
			nodes = append(nodes, o.NodeID)
		}
	}
	return nodes
}

// sameGang reports whether o and a are parts of one attempt of a
// multi-machine job, as the same plan describes it: both gang parts of the
// same attempt, over the same machines.
func sameGang(o, a contracts.Allocation) bool {
	return o.Gang != nil && a.Gang != nil && o.Attempt == a.Attempt &&
		o.Gang.Size == a.Gang.Size && slices.Equal(o.Gang.Nodes, a.Gang.Nodes)
}

// checkAdmin refuses new work on a node that is cordoned or being
// drained, saying who asked and why when the record does: an
// administrator (no Cause) or the platform (Cause, e.g.
// spot_interruption).
func (n *node) checkAdmin() Verdict {
	ad := n.admin
	if !ad.Cordoned && !ad.Drain {
		return Verdict{}
	}
	what, by := holdWords(ad.Drain, ad.Cause)
	return refuse(contracts.RefusedNodeCordoned, "node %s is %s %s: %s", n.id, what, by, orNoReason(ad.Reason))
}

// checkGPUHold refuses new work on a GPU held on its own (a sick or hot
// GPU, or one an administrator held by hand) while the rest of its node
// takes work. A MIG instance or a share is held by its parent GPU: d.UUID
// always names the physical GPU (the instance is d.MIG.UUID), and a hold
// is about the hardware, so every slice of it is kept off.
func (n *node) checkGPUHold(d contracts.DeviceRef) Verdict {
	if !n.admin.Held(d.UUID) {
		return Verdict{}
	}
	h := n.admin.GPUs[d.UUID]
	what, by := holdWords(h.Drain, h.Cause)
	return refuse(contracts.RefusedNodeCordoned, "GPU %s on node %s is %s %s: %s", d.UUID, n.id, what, by, orNoReason(h.Reason))
}

// holdWords say what a hold does and who put it there: an administrator
// (no cause) or the platform (a cause such as spot_interruption).
func holdWords(drain bool, cause contracts.Reason) (what, by string) {
	what, by = "cordoned", "by an administrator"
	if drain {
		what = "being drained"
	}
	if cause != "" {
		by = "for " + string(cause)
	}
	return what, by
}

func orNoReason(why string) string {
	if why == "" {
		return "no reason given"
	}
	return why
}

// checkHost checks the item's host CPU and memory against what the node's
// inventory declares less what its live allocations hold. Subtract, never
// add: the used sums may pass the capacity after an inventory shrank.
func (n *node) checkHost(a contracts.Allocation) Verdict {
	if a.CPUMilli > 0 && n.cpuCap > 0 && a.CPUMilli > n.cpuCap-n.cpuUsed {
		return refuse(contracts.RefusedHostCapacity, "node %s has %d of %d milli-CPUs held; %d more do not fit",
			n.id, n.cpuUsed, n.cpuCap, a.CPUMilli)
	}
	if a.MemoryMiB > 0 && n.memCap > 0 && a.MemoryMiB > n.memCap-n.memUsed {
		return refuse(contracts.RefusedHostCapacity, "node %s has %d of %d MiB of host memory held; %d MiB more do not fit",
			n.id, n.memUsed, n.memCap, a.MemoryMiB)
	}
	return Verdict{}
}

// hostHeld is what an allocation counts against its node's host: its CPU
// and memory, bounded to what a valid plan may ask (entries in the log
// were verified, but the sums must never overflow whatever it holds).
func hostHeld(a contracts.Allocation) (cpuMilli, memoryMiB int64) {
	return min(max(a.CPUMilli, 0), contracts.MaxCPUMilli), min(max(a.MemoryMiB, 0), contracts.MaxHostMemoryMiB)
}

// checkMode checks that the inventory's GPU g can give what d asks of it.
func (n *node) checkMode(d contracts.DeviceRef, g contracts.GPUInfo) Verdict {
	if err := n.migInvalid[d.UUID]; err != nil {
		return refuse(contracts.RefusedMIGInventoryInvalid, "GPU %s on node %s reports an inconsistent MIG state: %v", d.UUID, n.id, err)
	}
	if kindOf(d) != claimMIG {
		if g.MIGEnabled {
			return refuse(contracts.RefusedMIGEnabled, "GPU %s on node %s is in MIG mode: only its MIG instances can be allocated", d.UUID, n.id)
		}
		return Verdict{}
	}
	if !g.MIGEnabled {
		return refuse(contracts.RefusedMIGDisabled, "GPU %s on node %s is not in MIG mode", d.UUID, n.id)
	}
	i := slices.IndexFunc(g.MIGInstances, func(m contracts.MIGInstance) bool { return m.UUID == d.MIG.UUID })
	if i < 0 {
		return refuse(contracts.RefusedMIGInstanceUnknown, "GPU %s on node %s has no MIG instance %s", d.UUID, n.id, d.MIG.UUID)
	}
	if m := g.MIGInstances[i]; m.Profile != d.MIG.Profile || m.Start != d.MIG.Start || m.Size != d.MIG.Size {
		return refuse(contracts.RefusedMIGInstanceUnknown, "MIG instance %s of GPU %s on node %s is %s at %d:%d, not %s at %d:%d",
			m.UUID, d.UUID, n.id, m.Profile, m.Start, m.Size, d.MIG.Profile, d.MIG.Start, d.MIG.Size)
	}
	return Verdict{}
}

// checkFree checks that what d asks is not held by a live allocation and,
// for a share, that the shares held plus d's fit the card (checkMode ran
// first, so the GPU is in the inventory).
func (n *node) checkFree(d contracts.DeviceRef) Verdict {
	whole, migOn, shares := n.whole[d.UUID], n.migOn[d.UUID], n.shares[d.UUID]
	switch kindOf(d) {
	case claimWhole:
		switch {
		case len(whole) > 0:
			return refuse(contracts.RefusedDeviceTaken, "GPU %s on node %s is held by %s", d.UUID, n.id, whole[0])
		case len(migOn) > 0:
			return refuse(contracts.RefusedGPUShared, "a MIG instance of GPU %s on node %s is held by %s", d.UUID, n.id, migOn[0])
		case len(shares) > 0:
			return refuse(contracts.RefusedGPUShared, "GPU %s on node %s is shared by %s", d.UUID, n.id, shares[0].id)
		}
	case claimMIG:
		switch {
		case len(n.mig[d.MIG.UUID]) > 0:
			return refuse(contracts.RefusedMIGInstanceTaken, "MIG instance %s of GPU %s on node %s is held by %s", d.MIG.UUID, d.UUID, n.id, n.mig[d.MIG.UUID][0])
		case len(whole) > 0:
			return refuse(contracts.RefusedDeviceTaken, "GPU %s on node %s is held by %s", d.UUID, n.id, whole[0])
		case len(shares) > 0:
			return refuse(contracts.RefusedDeviceTaken, "GPU %s on node %s is shared by %s", d.UUID, n.id, shares[0].id)
		}
	case claimShare:
		switch {
		case len(whole) > 0:
			return refuse(contracts.RefusedDeviceTaken, "GPU %s on node %s is held by %s", d.UUID, n.id, whole[0])
		case len(migOn) > 0:
			return refuse(contracts.RefusedDeviceTaken, "a MIG instance of GPU %s on node %s is held by %s", d.UUID, n.id, migOn[0])
		}
		used := sumShares(shares)
		g := n.devices[d.UUID]
		// Subtract, never add: a plan's MemoryMiB may be near MaxInt64.
		if d.Share.MemoryMiB > g.MemoryMiB-used.MemoryMiB || d.Share.ComputePercent > 100-used.ComputePercent {
			return refuse(contracts.RefusedShareExceedsGPU, "GPU %s on node %s has %d of %d MiB and %d%% of its compute shared; %d MiB and %d%% more do not fit",
				d.UUID, n.id, used.MemoryMiB, g.MemoryMiB, used.ComputePercent, d.Share.MemoryMiB, d.Share.ComputePercent)
		}
	}
	return Verdict{}
}

func sumShares(cs []shareClaim) (sum contracts.GPUShare) {
	for _, c := range cs {
		sum.MemoryMiB += c.share.MemoryMiB
		sum.ComputePercent += c.share.ComputePercent
	}
	return sum
}

// validate checks what an item must be on its own.
func validate(a contracts.Allocation) Verdict {
	var errs []string
	if err := contracts.ValidateTenant(a.Tenant); err != nil {
		errs = append(errs, err.Error())
	}
	if err := contracts.ValidateID(a.JobID); err != nil {
		errs = append(errs, "job: "+err.Error())
	}
	if err := contracts.ValidateID(a.NodeID); err != nil {
		errs = append(errs, "node: "+err.Error())
	}
	if a.Attempt < 1 {
		errs = append(errs, fmt.Sprintf("attempt %d < 1", a.Attempt))
	}
	errs = append(errs, validateGang(a)...)
	if a.CPUMilli < 0 || a.CPUMilli > contracts.MaxCPUMilli {
		errs = append(errs, fmt.Sprintf("cpu %d milli-CPUs, want 0..%d", a.CPUMilli, contracts.MaxCPUMilli))
	}
	if a.MemoryMiB < 0 || a.MemoryMiB > contracts.MaxHostMemoryMiB {
		errs = append(errs, fmt.Sprintf("host memory %d MiB, want 0..%d", a.MemoryMiB, contracts.MaxHostMemoryMiB))
	}
	if len(a.Devices) == 0 {
		errs = append(errs, "no devices")
	}
	gpus := make(map[string]claimKind, len(a.Devices))
	migs := map[string]bool{}
	for _, d := range a.Devices {
		if d.UUID == "" {
			errs = append(errs, "a device has no UUID")
			continue
		}
		errs = append(errs, validateRef(d)...)
		k := kindOf(d)
		if prev, ok := gpus[d.UUID]; ok {
			if prev == claimWhole && k == claimWhole {
				errs = append(errs, "device "+d.UUID+" twice")
			} else if prev != claimMIG || k != claimMIG {
				errs = append(errs, "GPU "+d.UUID+" named more than once (only distinct MIG instances of one GPU may be)")
			}
		}
		gpus[d.UUID] = k
		if k == claimMIG && d.MIG.UUID != "" {
			if migs[d.MIG.UUID] {
				errs = append(errs, "MIG instance "+d.MIG.UUID+" twice")
			}
			migs[d.MIG.UUID] = true
		}
	}
	if len(errs) > 0 {
		return refuse(contracts.RefusedInvalidPlan, "%s", strings.Join(errs, "; "))
	}
	return Verdict{}
}

// validateGang checks the allocation's ID and, for a part of a
// multi-machine job, the part: a rank within the size, one distinct valid
// node per rank, this part's node at its rank, and the ID
// AllocationPartID of that rank.
func validateGang(a contracts.Allocation) []string {
	g := a.Gang
	if g == nil {
		if want := contracts.AllocationID(a.Tenant, a.JobID, a.Attempt); a.ID != want {
			return []string{fmt.Sprintf("id %q is not %q", a.ID, want)}
		}
		return nil
	}
	var errs []string
	if want := contracts.AllocationPartID(a.Tenant, a.JobID, a.Attempt, g.Rank); a.ID != want {
		errs = append(errs, fmt.Sprintf("id %q of a gang part is not %q", a.ID, want))
	}
	switch {
	case g.Size < 1 || g.Size > contracts.MaxNodesPerJob:
		errs = append(errs, fmt.Sprintf("gang size %d, want 1..%d", g.Size, contracts.MaxNodesPerJob))
	case g.Rank < 0 || g.Rank >= g.Size:
		errs = append(errs, fmt.Sprintf("gang rank %d, want 0..%d", g.Rank, g.Size-1))
	case len(g.Nodes) != g.Size:
		errs = append(errs, fmt.Sprintf("gang of %d parts names %d nodes", g.Size, len(g.Nodes)))
	case g.Nodes[g.Rank] != a.NodeID:
		errs = append(errs, fmt.Sprintf("gang rank %d is node %q, not %q", g.Rank, g.Nodes[g.Rank], a.NodeID))
	default:
		seen := make(map[string]bool, len(g.Nodes))
		for _, node := range g.Nodes {
			if err := contracts.ValidateID(node); err != nil || seen[node] {
				errs = append(errs, fmt.Sprintf("gang node %q is invalid or named twice (one part per machine)", node))
				break
			}
			seen[node] = true
		}
	}
	return errs
}

// validateRef checks a MIG or share ref on its own.
func validateRef(d contracts.DeviceRef) []string {
	var errs []string
	if d.MIG != nil && d.Share != nil {
		errs = append(errs, fmt.Sprintf("device %s asks for both a MIG instance and a share", d.UUID))
	}
	if d.MIG != nil && d.MIG.UUID == "" {
		errs = append(errs, fmt.Sprintf("device %s: MIG instance has no UUID", d.UUID))
	}
	if s := d.Share; s != nil {
		if s.MemoryMiB <= 0 {
			errs = append(errs, fmt.Sprintf("device %s: share of %d MiB, want > 0", d.UUID, s.MemoryMiB))
		}
		if s.ComputePercent < 1 || s.ComputePercent > 100 {
			errs = append(errs, fmt.Sprintf("device %s: share of %d%% compute, want 1..100", d.UUID, s.ComputePercent))
		}
	}
	return errs
}

// samePlacement reports whether a and b put the same allocation on the same
// devices of the same node (device order aside): the same GPUs whole, the
// same MIG instances, the same shares of the same GPUs.
func samePlacement(a, b contracts.Allocation) bool {
	if a.ID != b.ID || a.NodeID != b.NodeID || len(a.Devices) != len(b.Devices) {
		return false
	}
	keys := make(map[string]int, len(a.Devices))
	for _, d := range a.Devices {
		keys[deviceKey(d)]++
	}
	for _, d := range b.Devices {
		k := deviceKey(d)
		if keys[k] == 0 {
			return false
		}
		keys[k]--
	}
	return true
}

// deviceKey names what d claims.
func deviceKey(d contracts.DeviceRef) string {
	switch kindOf(d) {
	case claimMIG:
		return "mig/" + d.UUID + "/" + d.MIG.UUID
	case claimShare:
		return fmt.Sprintf("share/%s/%d/%d", d.UUID, d.Share.MemoryMiB, d.Share.ComputePercent)
	default:
		return "gpu/" + d.UUID
	}
}

func jobKey(a contracts.Allocation) string { return a.Tenant + "/" + a.JobID }

// Apply folds one ledger entry, stored at stream sequence seq on its node's
// subject, into the ledger. An entry at or below the node's last applied
// sequence changes nothing (seq 0 means unknown: applied idempotently
// without moving the sequence). It returns an error wrapping ErrInvalidEntry
// for an entry it cannot place, or ErrConflict when the log gives a held
// device to a second allocation.
func (l *Ledger) Apply(e contracts.LedgerEntry, seq uint64) error {
	a := e.Allocation
	if a.NodeID == "" || a.ID == "" {
		return fmt.Errorf("%w: allocation %q on node %q", ErrInvalidEntry, a.ID, a.NodeID)
	}
	if e.Kind != contracts.LedgerCommitted && e.Kind != contracts.LedgerReleased {
		return fmt.Errorf("%w: kind %q", ErrInvalidEntry, e.Kind)
	}
	n := l.node(a.NodeID)
	if seq != 0 {
		if seq <= n.lastSeq {
			return nil
		}
		n.lastSeq = seq
	}
	// Every entry moves the log's clock, which retired records are
	// forgotten by: applied in any interleaving of the nodes' subjects,
	// the same entries leave the same records (recset.Window).
	l.retired.Advance(e.Time)
	switch e.Kind {
	case contracts.LedgerCommitted:
		return l.commit(n, a)
	default:
		l.release(a, e.Time)
		return nil
	}
}

func (l *Ledger) commit(n *node, a contracts.Allocation) error {
	if _, ok := l.allocs[a.ID]; ok {
		return nil // already committed: idempotent
	}
	if l.isRetired(retiredKeyOf(a.ID)) {
		return nil // committed and released, or released first: idempotent
	}
	l.commits++
	l.allocs[a.ID] = &record{alloc: a, order: l.commits}
	n.live[a.ID] = struct{}{}
	l.liveJobs[jobKey(a)] = append(l.liveJobs[jobKey(a)], a.ID)
	cpu, mem := hostHeld(a)
	n.cpuUsed += cpu
	n.memUsed += mem
	var conflicts []string
	for _, d := range a.Devices {
		if c := n.conflict(d); c != "" {
			conflicts = append(conflicts, c)
		}
		n.claim(a.ID, d)
	}
	if len(conflicts) > 0 {
		return fmt.Errorf("%w: allocation %s on node %s: %s", ErrConflict, a.ID, n.id, strings.Join(conflicts, ", "))
	}
	return nil
}

func (l *Ledger) release(a contracts.Allocation, t time.Time) {
	r, ok := l.allocs[a.ID]
	if !ok {
		// A release of an allocation never seen committed, or released
		// already: remember the ID so a late commit of it stays a no-op.
		k := retiredKeyOf(a.ID)
		if !l.isRetired(k) {
			l.retire(k, retiredAlloc{place: placementHash(a), node: l.node(a.NodeID).idx}, t)
		}
		return
	}
	held := r.alloc
	n := l.node(held.NodeID)
	delete(l.allocs, held.ID)
	l.retire(retiredKeyOf(held.ID), retiredAlloc{place: placementHash(held), node: n.idx}, t)
	delete(n.live, held.ID)
	k := jobKey(held)
	if rest := slices.DeleteFunc(l.liveJobs[k], func(id string) bool { return id == held.ID }); len(rest) > 0 {
		l.liveJobs[k] = rest
	} else {
		delete(l.liveJobs, k)
	}
	cpu, mem := hostHeld(held)
	n.cpuUsed -= cpu
	n.memUsed -= mem
	for _, d := range held.Devices {
		n.unclaim(held.ID, d)
	}
}

// conflict says how claiming d now would break G1 (a thing held twice,
// a whole GPU mixed with a share or a MIG instance, shares past 100% of
// the compute or past the memory of an inventoried GPU); "" when it would
// not. It reads no inventory mode, so that the holdings rebuilt from the
// log do not depend on when the inventory arrived.
func (n *node) conflict(d contracts.DeviceRef) string {
	whole, migOn, shares := n.whole[d.UUID], n.migOn[d.UUID], n.shares[d.UUID]
	switch {
	case len(whole) > 0:
		return fmt.Sprintf("%s held whole by %s", d.UUID, whole[0])
	case kindOf(d) == claimMIG && len(n.mig[d.MIG.UUID]) > 0:
		return fmt.Sprintf("MIG instance %s of %s held by %s", d.MIG.UUID, d.UUID, n.mig[d.MIG.UUID][0])
	case kindOf(d) != claimMIG && len(migOn) > 0:
		return fmt.Sprintf("%s has a MIG instance held by %s", d.UUID, migOn[0])
	case kindOf(d) != claimShare && len(shares) > 0:
		return fmt.Sprintf("%s shared by %s", d.UUID, shares[0].id)
	case kindOf(d) == claimShare:
		used := sumShares(shares)
		g, known := n.devices[d.UUID]
		if d.Share.ComputePercent > 100-used.ComputePercent || known && d.Share.MemoryMiB > g.MemoryMiB-used.MemoryMiB {
			return fmt.Sprintf("%s shares pass the card with %d MiB and %d%% more", d.UUID, d.Share.MemoryMiB, d.Share.ComputePercent)
		}
	}
	return ""
}

// claim records that allocation id holds d.
func (n *node) claim(id string, d contracts.DeviceRef) {
	switch kindOf(d) {
	case claimMIG:
		n.mig[d.MIG.UUID] = append(n.mig[d.MIG.UUID], id)
		n.migOn[d.UUID] = append(n.migOn[d.UUID], id)
	case claimShare:
		n.shares[d.UUID] = append(n.shares[d.UUID], shareClaim{id: id, share: *d.Share})
	default:
		n.whole[d.UUID] = append(n.whole[d.UUID], id)
	}
}

// unclaim drops every claim of allocation id on what d names; a claimant
// after it (only after an ErrConflict) becomes the holder, so the device
// stays held. Bounded by the claims on one GPU.
func (n *node) unclaim(id string, d contracts.DeviceRef) {
	drop := func(m map[string][]string, key string) {
		if rest := slices.DeleteFunc(m[key], func(h string) bool { return h == id }); len(rest) > 0 {
			m[key] = rest
		} else {
			delete(m, key)
		}
	}
	switch kindOf(d) {
	case claimMIG:
		drop(n.mig, d.MIG.UUID)
		drop(n.migOn, d.UUID)
	case claimShare:
		if rest := slices.DeleteFunc(n.shares[d.UUID], func(c shareClaim) bool { return c.id == id }); len(rest) > 0 {
			n.shares[d.UUID] = rest
		} else {
			delete(n.shares, d.UUID)
		}
	default:
		drop(n.whole, d.UUID)
	}
}
