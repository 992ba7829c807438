package fragsim

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
)

// TestFragAwareNotAboveFGD replays every pod list of the trace with FGD
// and FragAware under the paper's protocol and fails at any whole arrival
// point (1..130%) where FragAware's median unallocated share is above
// FGD's: a task refused while FGD still placed everything is capacity
// lost, whatever the 100% figure says (issue 17; before the reserve term
// multigpu20 was above FGD from 79% to 95% arrived). It runs the first
// FRAGSIM_SEEDS seeds of the paper's 42..51 (3 by default, about a minute
// on one core; 10 is the paper's protocol, which `make bench` runs through
// tracesim), and checks that FragAware keeps its lead at 100% and above.
func TestFragAwareNotAboveFGD(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("replays of the whole Alibaba trace: not with -short or -race")
	}
	dir := traceDir(t)
	seeds := 3
	if v := os.Getenv("FRAGSIM_SEEDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 10 {
			t.Fatalf("FRAGSIM_SEEDS=%q: want 1..10", v)
		}
		seeds = n
	}
	nodes, models, err := LoadNodesFile(filepath.Join(dir, "openb_node_list_gpu_node.csv"))
	if err != nil {
		t.Fatal(err)
	}
	lists, err := filepath.Glob(filepath.Join(dir, "openb_pod_list_*.csv"))
	if err != nil || len(lists) == 0 {
		t.Fatalf("no pod list in %s: %v", dir, err)
	}
	for _, path := range lists {
		t.Run(ListName(path), func(t *testing.T) {
			pods, err := LoadPodsFile(path, models)
			if err != nil {
				t.Fatal(err)
			}
			e := Experiment{Nodes: nodes, Pods: pods, Policies: []string{"fgd", "fragaware"},
				Inflation: DefaultInflation, Parallel: runtime.GOMAXPROCS(0)}
			for i := range seeds {
				e.Seeds = append(e.Seeds, 42+uint64(i))
			}
			runs, err := e.Run(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			fgd, ours := runs[0], runs[1]
			for _, x := range Above(ours, fgd, 130) {
				t.Errorf("at %g%% arrived FragAware leaves %.2f%% unallocated, FGD %.2f%%", x, ours.Median(x), fgd.Median(x))
			}
			for _, x := range []float64{100, 110, 130} {
				if ours.Median(x) >= fgd.Median(x) {
					t.Errorf("at %g%% arrived FragAware %.2f%% has lost its lead over FGD %.2f%%", x, ours.Median(x), fgd.Median(x))
				}
			}
			t.Logf("unallocated %% at 90/95/100/130%% arrived: FGD %.2f/%.2f/%.2f/%.2f, FragAware %.2f/%.2f/%.2f/%.2f",
				fgd.Median(90), fgd.Median(95), fgd.Median(100), fgd.Median(130),
				ours.Median(90), ours.Median(95), ours.Median(100), ours.Median(130))
		})
	}
}
