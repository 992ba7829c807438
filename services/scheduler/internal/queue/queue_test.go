package queue

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

type push struct {
	key, tenant string
	prio        contracts.Priority
	seq         uint64
}

func order(q *Queue[int]) []string {
	var keys []string
	for it := range q.Order() {
		keys = append(keys, it.Key)
	}
	return keys
}

func TestOrder(t *testing.T) {
	const (
		crit = contracts.PriorityCritical
		high = contracts.PriorityHigh
		norm = contracts.PriorityNormal
		be   = contracts.PriorityBestEffort
	)
	tests := map[string]struct {
		pushes []push
		remove []string
		want   []string
	}{
		"empty": {want: nil},
		"fifo within a class by submit order": {
			pushes: []push{{"a3", "acme", norm, 3}, {"a1", "acme", norm, 1}, {"a2", "acme", norm, 2}},
			want:   []string{"a1", "a2", "a3"},
		},
		"highest class first across tenants": {
			pushes: []push{
				{"a-be", "acme", be, 1}, {"a-norm", "acme", norm, 2}, {"b-high", "beta", high, 3},
				{"c-crit", "corp", crit, 4}, {"a-high", "acme", high, 5},
			},
			want: []string{"c-crit", "a-high", "b-high", "a-norm", "a-be"},
		},
		"empty priority is normal": {
			pushes: []push{{"n", "acme", "", 2}, {"h", "acme", high, 3}, {"b", "acme", be, 1}},
			want:   []string{"h", "n", "b"},
		},
		"round-robin between tenants within a class": {
			pushes: []push{
				{"a1", "acme", norm, 1}, {"a2", "acme", norm, 2}, {"a3", "acme", norm, 3},
				{"b1", "beta", norm, 4}, {"c1", "corp", norm, 5}, {"c2", "corp", norm, 6},
			},
			want: []string{"a1", "b1", "c1", "a2", "c2", "a3"},
		},
		"removed items are skipped": {
			pushes: []push{{"a1", "acme", norm, 1}, {"a2", "acme", norm, 2}, {"b1", "beta", norm, 3}},
			remove: []string{"a1", "b1"},
			want:   []string{"a2"},
		},
		"requeued job gets its original place back": {
			pushes: []push{{"a2", "acme", norm, 2}, {"a3", "acme", norm, 3}, {"a1", "acme", norm, 1}},
			want:   []string{"a1", "a2", "a3"},
		},
		"duplicate push is ignored": {
			pushes: []push{{"a1", "acme", norm, 1}, {"a1", "acme", norm, 9}},
			want:   []string{"a1"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			q := New[int]()
			for _, p := range tc.pushes {
				q.Push(Item[int]{Key: p.key, Tenant: p.tenant, Priority: p.prio, Seq: p.seq})
			}
			for _, k := range tc.remove {
				if !q.Remove(k) {
					t.Fatalf("Remove(%q) = false, want true", k)
				}
			}
			if diff := cmp.Diff(tc.want, order(q)); diff != "" {
				t.Errorf("order (-want +got):\n%s", diff)
			}
			if q.Len() != len(tc.want) {
				t.Errorf("Len = %d, want %d", q.Len(), len(tc.want))
			}
		})
	}
}

func TestRemoveAndCompaction(t *testing.T) {
	q := New[int]()
	const n = 200
	for i := range n {
		q.Push(Item[int]{Key: string(rune('A' + i)), Tenant: "acme", Seq: uint64(i)})
	}
	// Remove every item but the last ten, forcing compaction on the way.
	for i := range n - 10 {
		if !q.Remove(string(rune('A' + i))) {
			t.Fatalf("Remove %d failed", i)
		}
	}
	if q.Remove(string(rune('A'))) {
		t.Fatal("second Remove of the same key reported true")
	}
	got := order(q)
	if len(got) != 10 || got[0] != string(rune('A'+n-10)) {
		t.Fatalf("after removals order = %q, want the last ten in order", got)
	}
	// A removed key can come back.
	q.Push(Item[int]{Key: "A", Tenant: "acme", Seq: 0})
	if got := order(q); got[0] != "A" || len(got) != 11 {
		t.Fatalf("re-pushed key: order = %q", got)
	}
	if !q.Contains("A") || q.Contains(string(rune('B'))) {
		t.Fatal("Contains disagrees with the pushes and removals")
	}
}

func TestOrderStopsEarly(t *testing.T) {
	q := New[int]()
	for i, tenant := range []string{"acme", "beta", "corp"} {
		q.Push(Item[int]{Key: tenant, Tenant: tenant, Seq: uint64(i)})
	}
	n := 0
	for range q.Order() {
		n++
		if n == 2 {
			break
		}
	}
	if n != 2 {
		t.Fatalf("iterated %d items after break, want 2", n)
	}
}
