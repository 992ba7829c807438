package ledger

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// checkStateRoundTrip loads l's exported state into a new ledger (with the
// model's inventories, readiness and holds, as a rebuild reads them from
// their own logs) and checks that it has l's digest, answers Verify and
// Allocation as l does, and that the whole log read again (at its
// sequences, then without) changes neither.
func checkStateRoundTrip(l *Ledger, m *model, log []stored, randomItem func() contracts.Allocation) error {
	r, err := FromState(l.Export(), testKeep)
	if err != nil {
		return fmt.Errorf("FromState: %w", err)
	}
	for node, inv := range m.inv {
		_ = r.SetInventory(contracts.NodeInventory{NodeID: node, GPUs: inv, CPUMilli: m.host[node].CPUMilli, MemoryMiB: m.host[node].MemoryMiB})
	}
	for node, ready := range m.ready {
		r.SetReady(node, ready)
	}
	for node, ad := range m.admin {
		r.SetAdmin(node, ad)
	}
	check := func(when string) error {
		if l.Digest() != r.Digest() {
			return fmt.Errorf("%s: digest of the ledger loaded from its state differs", when)
		}
		for range 20 {
			a := randomItem()
			if v, w := l.Verify(a), r.Verify(a); v != w {
				return fmt.Errorf("%s: Verify(%s on %s): ledger %+v, loaded %+v", when, a.ID, a.NodeID, v, w)
			}
		}
		for _, s := range log {
			id := s.e.Allocation.ID
			a, live, ok := l.Allocation(id)
			b, blive, bok := r.Allocation(id)
			if live != blive || ok != bok || a.NodeID != b.NodeID {
				return fmt.Errorf("%s: Allocation(%s): ledger %s %v %v, loaded %s %v %v", when, id, a.NodeID, live, ok, b.NodeID, blive, bok)
			}
		}
		return nil
	}
	if err := check("loaded"); err != nil {
		return err
	}
	for _, at := range []bool{true, false} {
		for _, s := range log {
			seq := s.seq
			if !at {
				seq = 0
			}
			for _, x := range []*Ledger{l, r} {
				if err := x.Apply(s.e, seq); err != nil && !errors.Is(err, ErrConflict) {
					return fmt.Errorf("log read again: %w", err)
				}
			}
		}
		if err := check(fmt.Sprintf("log read again (at its sequences: %v)", at)); err != nil {
			return err
		}
	}
	return nil
}

// A released allocation keeps no whole record: the ledger's whole records
// are its live allocations, however many have ended.
func TestEndedAllocationsLeaveOnlyRetiredRecords(t *testing.T) {
	l := fixture(t)
	base, baseRetired := l.Records(), l.Retired()
	seq := uint64(100)
	for i := range 500 {
		a := alloc("acme", fmt.Sprintf("ended-%d", i), 1, "n1", dev("n1", 1, "H100-80GB"))
		seq++
		if err := l.Apply(committed(a), seq); err != nil {
			t.Fatal(err)
		}
		seq++
		if err := l.Apply(released(a), seq); err != nil {
			t.Fatal(err)
		}
		// Its commit, redelivered, is still the duplicate it was.
		if v := l.Verify(a); !v.Duplicate {
			t.Fatalf("Verify of ended %s = %+v, want Duplicate", a.ID, v)
		}
		other := alloc("acme", fmt.Sprintf("ended-%d", i), 1, "n1", dev("n1", 2, "H100-80GB"))
		if v := l.Verify(other); v.Reason != contracts.RefusedAlreadyPlaced {
			t.Fatalf("Verify of ended %s elsewhere = %+v, want %s", a.ID, v, contracts.RefusedAlreadyPlaced)
		}
	}
	if got := l.Records(); got != base {
		t.Fatalf("whole records = %d after 500 ended allocations, want %d (the live ones)", got, base)
	}
	if got := l.Retired(); got != baseRetired+500 {
		t.Fatalf("retired records = %d, want %d", got, baseRetired+500)
	}
}

func TestFromStateRefusesBrokenStates(t *testing.T) {
	l := fixture(t)
	good := l.Export()
	for _, tc := range []struct {
		name  string
		spoil func(*State)
	}{
		{"truncated retired record", func(s *State) { s.Retired = append(s.Retired, []byte{1, 2, 3}) }},
		{"retired record of an unknown node", func(s *State) {
			rec := make([]byte, RetiredRecordSize)
			rec[24] = 0xff
			s.Retired = append(s.Retired, rec)
		}},
		{"node twice", func(s *State) { s.Nodes = append(s.Nodes, s.Nodes[0]) }},
		{"live twice", func(s *State) { s.Live = append(s.Live, s.Live[0]) }},
		{"live without a node", func(s *State) { s.Live = append(s.Live, contracts.Allocation{ID: "x"}) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := good
			st.Nodes = append([]NodeSeq(nil), good.Nodes...)
			st.Live = append([]contracts.Allocation(nil), good.Live...)
			st.Retired = append([][]byte(nil), good.Retired...)
			tc.spoil(&st)
			if _, err := FromState(st, testKeep); !errors.Is(err, ErrBadState) {
				t.Fatalf("FromState = %v, want ErrBadState", err)
			}
		})
	}
}

// FromState reads the retired records where they lie, in pieces of any
// length (a record may straddle two): the ledger it builds is the one a
// single piece gives, and a length that is not whole records is refused.
func TestFromStateReadsRetiredRecordsInPieces(t *testing.T) {
	l := fixture(t)
	seq := uint64(100)
	for i := range 300 {
		a := alloc("acme", fmt.Sprintf("ended-%d", i), 1, "n1", dev("n1", 1, "H100-80GB"))
		for _, e := range []contracts.LedgerEntry{committed(a), released(a)} {
			seq++
			if err := l.Apply(e, seq); err != nil {
				t.Fatal(err)
			}
		}
	}
	st := l.Export()
	whole := bytes.Join(st.Retired, nil)
	one := st
	one.Retired = [][]byte{whole}
	want, err := FromState(one, testKeep)
	if err != nil {
		t.Fatal(err)
	}
	if want.Retired() != l.Retired() || want.Digest() != l.Digest() {
		t.Fatalf("from one piece: %d retired, digest equal %t", want.Retired(), want.Digest() == l.Digest())
	}
	for _, cut := range []int{1, 5, RetiredRecordSize - 1, RetiredRecordSize + 3, 3*RetiredRecordSize - 2, 1000} {
		var pieces [][]byte
		for off := 0; off < len(whole); off += cut {
			pieces = append(pieces, whole[off:min(off+cut, len(whole))])
		}
		split := st
		split.Retired = pieces
		got, err := FromState(split, testKeep)
		if err != nil {
			t.Fatalf("pieces of %d bytes: %v", cut, err)
		}
		if got.Digest() != want.Digest() {
			t.Fatalf("pieces of %d bytes: another ledger than from one piece", cut)
		}
	}
	short := st
	short.Retired = [][]byte{whole[:len(whole)-1]}
	if _, err := FromState(short, testKeep); !errors.Is(err, ErrBadState) {
		t.Fatalf("records one byte short: %v, want ErrBadState", err)
	}
}
