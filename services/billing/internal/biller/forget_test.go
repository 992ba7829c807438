package biller

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// fakeIndex is a store's Index: the allocations it holds, in a generation.
type fakeIndex struct {
	mu     sync.Mutex
	gen    string
	billed map[Key]bool
}

func (f *fakeIndex) Billed(_ context.Context, keys []Key) (string, []bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]bool, len(keys))
	for i, k := range keys {
		out[i] = f.billed[k]
	}
	return f.gen, out, nil
}

func (f *fakeIndex) add(ids ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, id := range ids {
		f.billed[KeyOf(id)] = true
	}
}

// TestForgetOnlyWhatTheIndexConfirms: the biller forgets a closed epoch
// of settled allocations only once the index holds every one of them, in
// one generation (and keepRounds rounds after it closed); what settles meanwhile waits for the next round; and a
// generation other than the one it forgot in makes it forget nothing more.
// An allocation it does not hold is then new exactly when the index does
// not hold it (it holds all the biller forgot).
func TestForgetOnlyWhatTheIndexConfirms(t *testing.T) {
	ctx := context.Background()
	idx := &fakeIndex{gen: "g1", billed: map[Key]bool{}}
	b := New(Config{Index: idx, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	subj := contracts.SubjectUsage("acme")
	seq := uint64(0)
	bill := func(ids ...string) {
		for _, id := range ids {
			seq++
			b.record(usage(id, 0, true, false, ""), subj, seq)
		}
	}
	ids := func(from, to int) []string {
		var out []string
		for i := from; i < to; i++ {
			out = append(out, fmt.Sprintf("acme/j%04d/1", i))
		}
		return out
	}
	// forget runs Forget for as many rounds as an epoch is kept, and one.
	forget := func(want int) {
		t.Helper()
		total := 0
		for range keepRounds + 1 {
			n, err := b.Forget(ctx)
			if err != nil {
				t.Fatal(err)
			}
			total += n
		}
		if total != want {
			t.Fatalf("Forget forgot %d; want %d", total, want)
		}
	}
	settled := func(want int) {
		t.Helper()
		if _, n := b.Retained(); n != want {
			t.Fatalf("%d settled held, want %d", n, want)
		}
	}

	bill(ids(0, 100)...)
	idx.add(ids(0, 99)...) // the store has not applied the last one yet
	forget(0)
	settled(100)
	bill(ids(100, 150)...) // settles in the next epoch
	idx.add(ids(99, 100)...)
	forget(100)
	settled(50)
	if st, ok := b.lookup("acme/j0007/1"); st != nil || ok {
		t.Fatalf("a forgotten allocation still held: %+v", st)
	}
	// Not held, not in the index: never billed. (One the index holds is
	// looked for in the tenant's subject first: the service's tests.)
	if st, ok, err := b.find(ctx, "acme/new/1", "acme", nil); err != nil || st != nil || ok {
		t.Fatalf("find of a new allocation = %+v, %v, %v; want nothing", st, ok, err)
	}

	// The store starts a new generation: it does not hold what was
	// forgotten in g1, so nothing more is forgotten on its word.
	idx.mu.Lock()
	idx.gen = "g2"
	idx.mu.Unlock()
	idx.add(ids(100, 150)...)
	forget(0)
	settled(50)
}
