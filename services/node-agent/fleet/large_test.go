package fleet

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

// largeFleetPath is the 2,000-machine fleet BenchmarkFleet measures.
var largeFleetPath = filepath.Join("..", "..", "..", "deploy", "fleet", "large.yaml")

func TestDeployedLargeFleet(t *testing.T) {
	if _, err := os.Stat(largeFleetPath); err != nil {
		t.Skipf("no deploy tree here (module built alone): %v", err)
	}
	f, err := Load(largeFleetPath)
	if err != nil {
		t.Fatal(err)
	}
	type shape struct{ Machines, GPUs int }
	byPrice, byZone, byPurpose, byTaint := map[string]shape{}, map[string]shape{}, map[string]shape{}, map[string]shape{}
	total := shape{}
	ids := map[string]bool{}
	for _, c := range f.Configs(nodeagent.DefaultConfig()) {
		if err := c.Validate(); err != nil {
			t.Fatalf("%s: %v", c.NodeID, err)
		}
		if ids[c.NodeID] {
			t.Fatalf("node ID %s twice", c.NodeID)
		}
		ids[c.NodeID] = true
		p, z := byPrice[c.PriceClass], byZone[c.Zone]
		p.Machines, p.GPUs = p.Machines+1, p.GPUs+c.GPUCount
		z.Machines, z.GPUs = z.Machines+1, z.GPUs+c.GPUCount
		byPrice[c.PriceClass], byZone[c.Zone] = p, z
		u := byPurpose[c.Purpose]
		byPurpose[c.Purpose] = shape{u.Machines + 1, u.GPUs + c.GPUCount}
		for _, tn := range c.Taints {
			k := nodeagent.FormatTaint(tn)
			byTaint[k] = shape{byTaint[k].Machines + 1, byTaint[k].GPUs + c.GPUCount}
		}
		total.Machines, total.GPUs = total.Machines+1, total.GPUs+c.GPUCount
	}
	want := map[string]any{
		"total":   shape{2000, 16000},
		"price":   map[string]shape{"on-demand": {800, 6400}, "reserved": {500, 4000}, "spot": {700, 5600}},
		"zone":    map[string]shape{"zone-a": {700, 5600}, "zone-b": {700, 5600}, "zone-c": {600, 4800}},
		"purpose": map[string]shape{"training": {1400, 11200}, "inference": {600, 4800}},
		"taint": map[string]shape{"gpuplane.io/spot=true:NoSchedule": {700, 5600},
			"gpuplane.io/dedicated=research:NoSchedule": {200, 1600}},
	}
	got := map[string]any{"total": total, "price": byPrice, "zone": byZone, "purpose": byPurpose, "taint": byTaint}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("large fleet (-want +got):\n%s", d)
	}
}
