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
// The digests are kept in epochs, the last one open: Forget (forget.go)
// closes it and drops whole epochs once the store confirms every
// allocation of them, so that what the biller keeps is what the store has
// not applied yet, not every allocation ever billed.
//
// The digest is SHA-256's first 16 bytes: job IDs are the tenants', and a
// digest a tenant could collide on purpose would let one of its
// allocations pass as billed.

// Key is the digest of an allocation's ID: how settled allocations are
// kept, and how the Index names them.
type Key [16]byte

// KeyOf is the Key of an allocation's ID.
func KeyOf(allocationID string) Key {
	sum := sha256.Sum256([]byte(allocationID))
	return Key(sum[:16])
}

// settledState is what is kept of a settled allocation: whether voids
// were published for it (a provisional record after voids is ignored).
type settledState struct {
	voiding bool
}

// epochSize bounds an epoch, so that a rebuild from a long USAGE leaves
// epochs Forget can confirm and drop one at a time.
const epochSize = 1 << 16

// epoch is a group of settled allocations, forgotten together.
type epoch struct {
	keys map[Key]settledState
	// closed is the Forget round that closed it (0: open).
	closed int
}

func newEpoch() *epoch { return &epoch{keys: map[Key]settledState{}} }

// isSettled reports whether st is billed to the agent's end, for good.
func (st *allocation) isSettled() bool {
	return st.final && !st.provisional && len(st.open) == 0
}

// settle moves id's allocation to settled once it is settled.
func (b *Biller) settle(id string, st *allocation) {
	if !st.isSettled() {
		return
	}
	open := b.settled[len(b.settled)-1]
	if len(open.keys) >= epochSize {
		open.closed = b.round
		open = newEpoch()
		b.settled = append(b.settled, open)
	}
	open.keys[KeyOf(id)] = settledState{voiding: st.voiding}
	delete(b.allocs, id)
}

// unsettle drops id from settled (a record came for it).
func (b *Biller) unsettle(id string) {
	k := KeyOf(id)
	for _, e := range b.settled {
		delete(e.keys, k)
	}
}

// lookup returns what the biller holds of id's allocation: its state (nil
// when none), and whether it is settled. A settled allocation's state is
// rebuilt (billed to its end) so that plan and record read it as before.
// An allocation it forgot is not found here (find).
func (b *Biller) lookup(id string) (st *allocation, settled bool) {
	if st := b.allocs[id]; st != nil {
		return st, false
	}
	k := KeyOf(id)
	for i := len(b.settled) - 1; i >= 0; i-- {
		if s, ok := b.settled[i].keys[k]; ok {
			return &allocation{final: true, voiding: s.voiding}, true
		}
	}
	return nil, false
}

func (b *Biller) settledLen() int {
	n := 0
	for _, e := range b.settled {
		n += len(e.keys)
	}
	return n
}

// Retained is how many allocations the biller keeps whole and how many as
// settled digests (not counting those it forgot).
func (b *Biller) Retained() (whole, settled int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.allocs), b.settledLen()
}
