package rules

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

// stateSize is how many keys hold alert state, over every rule, and how
// many series the engine keeps, over every scope.
func stateSize(e *Engine) (states, series int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, m := range e.state {
		states += len(m)
	}
	for _, m := range e.series {
		series += len(m)
	}
	return states, series
}

// TestChurnKeepsStateBounded churns spot machines through the engine, as
// an autoscaler with reclaimed spot capacity does: every 10 s a new machine
// of 8 GPUs joins, runs hot (gpu_hot fires on each GPU), and leaves 10 s
// later, never to return. The state held must stay bounded by the machines
// seen within the engine's span, not grow with every machine ever seen, and
// every episode must fire once and resolve once.
func TestChurnKeepsStateBounded(t *testing.T) {
	const (
		machines = 300
		gpusPer  = 8
		lifetime = 10 * time.Second
	)
	d := newDriver(t, only("gpu_hot", "gpu_memory_high"))
	d.tenants["a1"] = "acme"
	// Machines alive or quiet within the span (70 s: the 1 min summary
	// window plus two buckets), one more for the one joining, and one
	// series per node, pool and tenant.
	span := SummaryWindow + 2*5*time.Second
	bound := (int(span/lifetime) + 2) * (gpusPer + 1)
	end := time.Duration(machines)*lifetime + 2*span
	maxStates, maxSeries := 0, 0
	for at := time.Duration(0); at <= end; at += time.Second {
		if i := int(at / lifetime); i < machines {
			node := fmt.Sprintf("spot-%d", i)
			var gpus []contracts.GPUSample
			for j := range gpusPer {
				gpus = append(gpus, g(fmt.Sprintf("GPU-%d-%d", i, j), func(s *contracts.GPUSample) {
					s.TempC, s.Index, s.AllocationID = 90, j, "a1"
				}))
			}
			d.ingest(at, node, "spot", gpus...)
		}
		d.eval(at)
		states, series := stateSize(d.e)
		maxStates, maxSeries = max(maxStates, states), max(maxSeries, series)
	}
	if maxStates > bound || maxSeries > bound+2 {
		t.Errorf("held up to %d alert states and %d series for %d machines of %d GPUs; want at most %d and %d",
			maxStates, maxSeries, machines, gpusPer, bound, bound+2)
	}
	if states, series := stateSize(d.e); states != 0 || series != 0 {
		t.Errorf("after every machine left: %d alert states, %d series; want none", states, series)
	}
	// Each GPU's episode fired once and resolved once, episodes numbered
	// without reuse for the kind.
	fired, resolved := map[string]int{}, map[string]int{}
	for _, tr := range d.got {
		f := strings.Fields(tr)
		key := f[1] + "/" + f[2] + "/" + f[3]
		switch contracts.AlertState(f[4]) {
		case contracts.AlertFiring:
			fired[key]++
		case contracts.AlertResolved:
			resolved[key]++
		}
	}
	if len(fired) != machines*gpusPer {
		t.Errorf("%d episodes fired; want %d", len(fired), machines*gpusPer)
	}
	for key, n := range fired {
		if n != 1 || resolved[key] != 1 {
			t.Errorf("episode %s: fired %d times, resolved %d times; want once each", key, n, resolved[key])
		}
	}
	if got := d.e.Firing()["gpu_hot"]; got != 0 {
		t.Errorf("Firing()[gpu_hot] = %d after every machine left; want 0", got)
	}
}

// TestDepartedNodeResolvesOnce: a GPU hot when its machine leaves has its
// alert resolved once its window empties, never fired again while it is
// gone, and its state is dropped once its series is forgotten. If the same
// GPU comes back (a node reusing the UUID), its next episode is numbered
// above the old one: the old alert IDs stay unique.
func TestDepartedNodeResolvesOnce(t *testing.T) {
	tests := map[string]struct {
		// restore is applied before the machine reports.
		restore []contracts.Alert
		// comesBack is when the GPU reports again, hot; 0: never.
		comesBack time.Duration
		want      []string
	}{
		"leaves while hot": {
			want: []string{"0s gpu_hot G1 1 firing", "15s gpu_hot G1 1 resolved"},
		},
		"leaves while hot, comes back hot after its state went": {
			comesBack: 200 * time.Second,
			want: []string{"0s gpu_hot G1 1 firing", "15s gpu_hot G1 1 resolved",
				"3m20s gpu_hot G1 2 firing"},
		},
		"restored episode 5, leaves, comes back": {
			restore: []contracts.Alert{{Kind: "gpu_hot", Key: "G1", State: contracts.AlertFiring, Since: t0,
				Labels: map[string]string{contracts.AlertLabelEpisode: "5"}}},
			comesBack: 200 * time.Second,
			want:      []string{"15s gpu_hot G1 5 resolved", "3m20s gpu_hot G1 6 firing"},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			d := newDriver(t, only("gpu_hot"))
			for _, a := range tc.restore {
				if ours, err := d.e.Restore(a); !ours || err != nil {
					t.Fatalf("Restore(%+v) = %v, %v", a, ours, err)
				}
			}
			hot := func(time.Duration) []contracts.GPUSample { return []contracts.GPUSample{g("G1", temp(90))} }
			// Reports hot for 10 s, then its machine is deleted.
			d.each(0, 9*time.Second, "n1", "p", hot)
			for at := 10 * time.Second; at < 200*time.Second; at += time.Second {
				d.eval(at)
			}
			if states, series := stateSize(d.e); states != 0 || series != 0 {
				t.Errorf("190 s after the machine left: %d alert states, %d series; want none", states, series)
			}
			if tc.comesBack > 0 {
				d.each(tc.comesBack, tc.comesBack, "n1", "p", hot)
			}
			if diff := cmp.Diff(tc.want, d.got); diff != "" {
				t.Errorf("transitions (-want +got):\n%s", diff)
			}
		})
	}
}

// TestDroppedStateNeverReusesEpisodes: the floor a dropped key leaves is
// per rule, so a key met for the first time after another's state was
// dropped numbers its episodes above every dropped one.
func TestDroppedStateNeverReusesEpisodes(t *testing.T) {
	d := newDriver(t, only("gpu_hot"))
	if _, err := d.e.Restore(contracts.Alert{Kind: "gpu_hot", Key: "OLD", State: contracts.AlertResolved, Since: t0,
		Labels: map[string]string{contracts.AlertLabelEpisode: "7"}}); err != nil {
		t.Fatal(err)
	}
	d.eval(0) // OLD never reports: its resolved state goes at once
	if states, _ := stateSize(d.e); states != 0 {
		t.Fatalf("%d alert states after a resolved key without series was evaluated; want 0", states)
	}
	d.each(time.Second, time.Second, "n1", "p", func(time.Duration) []contracts.GPUSample {
		return []contracts.GPUSample{g("OLD", temp(90)), g("NEW", temp(90))}
	})
	want := []string{"1s gpu_hot NEW 8 firing", "1s gpu_hot OLD 8 firing"}
	if diff := cmp.Diff(want, d.got); diff != "" {
		t.Errorf("transitions (-want +got):\n%s", diff)
	}
}
