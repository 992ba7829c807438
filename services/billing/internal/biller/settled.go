package biller

import "crypto/sha256"

// An allocation billed to its end on the agent's own end (its last record
// final, not provisional, nothing open to void) never bills again: every
// basis plan meets then is answered "nothing" (the table in the package
// comment). Yet its *allocation stayed in allocs for the life of the
// process, with its ID as the key: about 200 bytes per job ever billed,
// the part of billing's memory that grew with history (issue 17). Such an
// allocation is kept instead as a 16-byte digest of its ID in settled:
// plan answers from the digest alone, and a record that still came for
// it (none does: USAGE holds nothing after such a bill) folds into a state
// rebuilt from the digest (billed to its end), never a fresh one.
//
// The digest is SHA-256's first 16 bytes: job IDs are the tenants', and a
// digest a tenant could collide on purpose would let one of its
// allocations pass as billed.

// settledKey is the digest of a settled allocation's ID.
type settledKey [16]byte

func keyOf(allocationID string) settledKey {
	sum := sha256.Sum256([]byte(allocationID))
	return settledKey(sum[:16])
}

// settledState is what is kept of a settled allocation: whether voids
// were published for it (a provisional record after voids is ignored).
type settledState struct {
	voiding bool
}

// isSettled reports whether st is billed to the agent's end, for good.
func (st *allocation) isSettled() bool {
	return st.final && !st.provisional && len(st.open) == 0
}

// settle moves id's allocation to settled once it is settled.
func (b *Biller) settle(id string, st *allocation) {
	if !st.isSettled() {
		return
	}
	b.settled[keyOf(id)] = settledState{voiding: st.voiding}
	delete(b.allocs, id)
}

// lookup returns what is known of id's allocation: its state (nil when
// none), and whether it is settled. A settled allocation's state is
// rebuilt (billed to its end) so that plan and record read it as before.
func (b *Biller) lookup(id string) (st *allocation, settled bool) {
	if st := b.allocs[id]; st != nil {
		return st, false
	}
	s, ok := b.settled[keyOf(id)]
	if !ok {
		return nil, false
	}
	return &allocation{final: true, voiding: s.voiding}, true
}

// Retained is how many allocations the biller keeps whole and how many as
// settled digests.
func (b *Biller) Retained() (whole, settled int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.allocs), len(b.settled)
}
