// Package ledger is the resource manager's pure model of the allocation
// ledger: for every node, the devices its inventory declares, which
// allocation holds each device, and the last ledger stream sequence applied
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
// of the item); nothing here is O(total allocations).
package ledger

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
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
type node struct {
	id string
	// hasInventory: an inventory was seen; devices is its GPUs by UUID.
	hasInventory bool
	devices      map[string]contracts.GPUInfo
	// ready: registered and not lost (the liveness side's verdict).
	ready bool
	// holders maps a device UUID to the live allocation holding it.
	holders map[string]string
	// live is the set of live allocation IDs on the node.
	live map[string]struct{}
	// lastSeq is the stream sequence of the last ledger entry applied
	// from this node's subject.
	lastSeq uint64
}

// record is what the ledger keeps of one allocation ID ever committed.
type record struct {
	alloc    contracts.Allocation
	released bool
}

// Ledger is the allocation ledger of every node. The zero value is not
// usable; call New.
type Ledger struct {
	nodes  map[string]*node
	allocs map[string]*record
	// liveJobs maps tenant/job to the job's live allocation ID: a job
	// holds at most one live allocation (J1).
	liveJobs map[string]string
}

// New returns an empty ledger.
func New() *Ledger {
	return &Ledger{nodes: map[string]*node{}, allocs: map[string]*record{}, liveJobs: map[string]string{}}
}

func (l *Ledger) node(id string) *node {
	n, ok := l.nodes[id]
	if !ok {
		n = &node{id: id, devices: map[string]contracts.GPUInfo{}, holders: map[string]string{}, live: map[string]struct{}{}}
		l.nodes[id] = n
	}
	return n
}

// SetInventory replaces the devices of inv.NodeID with inv.GPUs (the latest
// inventory wins). Allocations holding devices the new inventory no longer
// lists keep them until released.
func (l *Ledger) SetInventory(inv contracts.NodeInventory) {
	n := l.node(inv.NodeID)
	n.hasInventory = true
	n.devices = make(map[string]contracts.GPUInfo, len(inv.GPUs))
	for _, g := range inv.GPUs {
		n.devices[g.UUID] = g
	}
}

// SetReady records whether a node may receive new allocations (registered
// and not lost).
func (l *Ledger) SetReady(nodeID string, ready bool) { l.node(nodeID).ready = ready }

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
func (l *Ledger) Allocation(id string) (a contracts.Allocation, live, ok bool) {
	r, ok := l.allocs[id]
	if !ok {
		return contracts.Allocation{}, false, false
	}
	return r.alloc, !r.released, true
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

// Holder returns the live allocation holding a device of a node, "" when free.
func (l *Ledger) Holder(nodeID, uuid string) string {
	if n, ok := l.nodes[nodeID]; ok {
		return n.holders[uuid]
	}
	return ""
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
//     twice).
//  2. the allocation ID is already in the ledger: Duplicate when it is the
//     identical allocation (same node, same devices), else
//     job_already_allocated; also job_already_allocated when another
//     attempt of the job is live.
//  3. unknown_node: no inventory for the node; node_not_ready: not
//     registered, or lost.
//  4. unknown_device: a UUID the inventory does not list, or listed at
//     another index; gpu_model_mismatch: the model differs.
//  5. device_taken: a device is held by a live allocation.
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
	if other, ok := l.liveJobs[jobKey(a)]; ok {
		return refuse(contracts.RefusedAlreadyPlaced, "job %s/%s already holds live allocation %s", a.Tenant, a.JobID, other)
	}
	n, ok := l.nodes[a.NodeID]
	if !ok || !n.hasInventory {
		return refuse(contracts.RefusedUnknownNode, "node %s has no inventory", a.NodeID)
	}
	if !n.ready {
		return refuse(contracts.RefusedNodeNotReady, "node %s is not registered or is lost", a.NodeID)
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
	}
	for _, d := range a.Devices {
		if h, taken := n.holders[d.UUID]; taken {
			return refuse(contracts.RefusedDeviceTaken, "GPU %s on node %s is held by %s", d.UUID, a.NodeID, h)
		}
	}
	return Verdict{}
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
	if want := contracts.AllocationID(a.Tenant, a.JobID, a.Attempt); a.ID != want {
		errs = append(errs, fmt.Sprintf("id %q is not %q", a.ID, want))
	}
	if len(a.Devices) == 0 {
		errs = append(errs, "no devices")
	}
	seen := make(map[string]bool, len(a.Devices))
	for _, d := range a.Devices {
		if d.UUID == "" {
			errs = append(errs, "a device has no UUID")
		} else if seen[d.UUID] {
			errs = append(errs, "device "+d.UUID+" twice")
		}
		seen[d.UUID] = true
	}
	if len(errs) > 0 {
		return refuse(contracts.RefusedInvalidPlan, "%s", strings.Join(errs, "; "))
	}
	return Verdict{}
}

// samePlacement reports whether a and b put the same allocation on the same
// devices of the same node (device order aside).
func samePlacement(a, b contracts.Allocation) bool {
	if a.ID != b.ID || a.NodeID != b.NodeID || len(a.Devices) != len(b.Devices) {
		return false
	}
	uuids := make(map[string]bool, len(a.Devices))
	for _, d := range a.Devices {
		uuids[d.UUID] = true
	}
	for _, d := range b.Devices {
		if !uuids[d.UUID] {
			return false
		}
	}
	return true
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
	switch e.Kind {
	case contracts.LedgerCommitted:
		return l.commit(n, a)
	default:
		l.release(a)
		return nil
	}
}

func (l *Ledger) commit(n *node, a contracts.Allocation) error {
	if _, ok := l.allocs[a.ID]; ok {
		return nil // already committed (and maybe released): idempotent
	}
	l.allocs[a.ID] = &record{alloc: a}
	n.live[a.ID] = struct{}{}
	l.liveJobs[jobKey(a)] = a.ID
	var conflicts []string
	for _, d := range a.Devices {
		if h, taken := n.holders[d.UUID]; taken {
			conflicts = append(conflicts, fmt.Sprintf("%s held by %s", d.UUID, h))
			continue
		}
		n.holders[d.UUID] = a.ID
	}
	if len(conflicts) > 0 {
		return fmt.Errorf("%w: allocation %s on node %s: %s", ErrConflict, a.ID, n.id, strings.Join(conflicts, ", "))
	}
	return nil
}

func (l *Ledger) release(a contracts.Allocation) {
	r, ok := l.allocs[a.ID]
	if !ok {
		// A release of an allocation never seen committed: remember the
		// ID so a late commit of it stays a no-op.
		l.allocs[a.ID] = &record{alloc: a, released: true}
		return
	}
	if r.released {
		return
	}
	r.released = true
	held := r.alloc
	n := l.node(held.NodeID)
	delete(n.live, held.ID)
	if l.liveJobs[jobKey(held)] == held.ID {
		delete(l.liveJobs, jobKey(held))
	}
	for _, d := range held.Devices {
		if n.holders[d.UUID] != held.ID {
			continue
		}
		delete(n.holders, d.UUID)
		// Only after an ErrConflict can another live allocation claim
		// the device; hand it over so it stays held. Bounded by the
		// node's live allocations.
		for id := range n.live {
			if slices.ContainsFunc(l.allocs[id].alloc.Devices, func(o contracts.DeviceRef) bool { return o.UUID == d.UUID }) {
				n.holders[d.UUID] = id
				break
			}
		}
	}
}
