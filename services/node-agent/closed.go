package nodeagent

import (
	"context"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// An allocation whose run has ended and that the ledger released is
// closed: nothing about it can change any more, and an agent that kept its
// facts and its release for good would grow with every run the machine
// ever ran (issue 17). A closed allocation leaves a.facts, a.released and
// a.stops; what it still has to answer is a redelivered commit (never
// start it again) and a stop (nothing to do), and both keep their answer:
//
//   - the last closedMemory closed IDs are remembered in a ring: the usual
//     redelivery (an ack lost moments ago) is answered from it;
//   - every commit of a closed allocation sits in the ledger before its
//     release, so its stream sequence is below closedBelow, the highest
//     release sequence of an allocation closed so far. A commit for an
//     unknown allocation below that mark (a redelivery, or a consumer that
//     was recreated and reads the ledger again) is looked up in the streams
//     of record (lookup): its run facts and its release are still there.
//     A commit delivered for the first time is always above the mark (the
//     consumer delivers in stream order), so the hot path never looks up.
//
// The streams stay the truth: nothing is forgotten that they do not hold.
const closedMemory = 1024

// releaseNote is what the agent keeps of a release: why, and where in the
// ledger (its stream sequence, for closedBelow).
type releaseNote struct {
	reason contracts.Reason
	seq    uint64
}

// closedRuns remembers the last closed allocations (see closedMemory).
type closedRuns struct {
	ids   map[string]struct{}
	ring  []string
	next  int
	limit int // closedMemory; tests lower it
	// below is the highest ledger sequence of a closed allocation's
	// release: every commit of a forgotten allocation is below it.
	below uint64
}

func (c *closedRuns) has(id string) bool {
	_, ok := c.ids[id]
	return ok
}

func (c *closedRuns) add(id string, releaseSeq uint64) {
	c.below = max(c.below, releaseSeq)
	if c.has(id) {
		return
	}
	if c.ids == nil {
		c.ids = map[string]struct{}{}
	}
	if c.limit <= 0 {
		c.limit = closedMemory
	}
	if len(c.ring) < c.limit {
		c.ring = append(c.ring, id)
	} else {
		delete(c.ids, c.ring[c.next])
		c.ring[c.next] = id
		c.next = (c.next + 1) % c.limit
	}
	c.ids[id] = struct{}{}
}

// maybeClose forgets allocation id once it is closed: released by the
// ledger, not running or being launched, and either ended or never
// started (released first). a.mu must be held.
func (a *agent) maybeClose(id string) {
	rel, released := a.released[id]
	if !released {
		return
	}
	if _, active := a.active[id]; active {
		return
	}
	if f := a.facts[id]; f != nil && !f.ended {
		return // started and not ended: recoverRuns must still find it
	}
	if _, pending := a.unstarted[id]; pending {
		return
	}
	delete(a.facts, id)
	delete(a.released, id)
	delete(a.stops, id)
	a.closed.add(id, rel.seq)
}

// mustLookUp reports whether a commit of id at ledger sequence seq may be
// one of a closed allocation the agent no longer remembers. a.mu must be
// held.
func (a *agent) mustLookUp(id string, seq uint64) bool {
	if a.closed.has(id) || a.facts[id] != nil || a.active[id] != nil {
		return false
	}
	if _, ok := a.released[id]; ok {
		return false
	}
	return seq <= a.closed.below
}

// lookup reads what the streams of record hold about allocation id (its
// run facts and, with ledger, its release) into the agent's maps, as the
// rebuild would have: an earlier delivery may have published a started
// fact whose acknowledgement was lost, or the allocation may have been
// closed and forgotten. Only id's messages are kept.
func (a *agent) lookup(ctx context.Context, id string, ledger bool) error {
	err := a.feed.Replay(ctx, contracts.StreamRuns, contracts.SubjectRuns(a.cfg.NodeID), func(_ context.Context, m *bus.Msg) error {
		if m.Header.Get(contracts.HeaderCESubject) != "" && m.Header.Get(contracts.HeaderCESubject) != id {
			return nil // another allocation's fact: not even decoded
		}
		var ev contracts.RunEvent
		if err := m.Decode(&ev); err != nil || ev.AllocationID != id {
			return nil
		}
		a.mu.Lock()
		a.recordFact(ev)
		a.mu.Unlock()
		return nil
	})
	if err != nil {
		return err
	}
	if !ledger {
		return nil
	}
	return a.feed.Replay(ctx, contracts.StreamAllocations, contracts.SubjectLedger(a.cfg.NodeID), func(_ context.Context, m *bus.Msg) error {
		if !fromResourceManager(m) {
			return nil
		}
		var e contracts.LedgerEntry
		if err := m.Decode(&e); err != nil || e.Allocation.ID != id || e.Kind != contracts.LedgerReleased {
			return nil
		}
		a.mu.Lock()
		a.released[id] = releaseNote{reason: e.Reason, seq: m.StreamSeq}
		a.maybeClose(id)
		a.mu.Unlock()
		return nil
	})
}
