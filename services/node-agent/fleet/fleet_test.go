package fleet

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
)

func TestDefaultFleet(t *testing.T) {
	f := Default()
	if err := f.Validate(); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, m := range f.Machines() {
		got[m.NodeID] = fmt.Sprint(m.GPUModel, " ", m.PriceClass, " ", m.Zone, " ", m.Purpose, " ", m.Taints)
	}
	const spot = "[{gpuplane.io/spot true PreferNoSchedule}]"
	want := map[string]string{
		"h100-01": "H100-80GB on-demand zone-a training []", "h100-02": "H100-80GB on-demand zone-a training []",
		"a100-01": "A100-80GB on-demand zone-b training []", "a100-02": "A100-80GB on-demand zone-b training []",
		"l4-01": "L4 spot zone-b inference " + spot, "l4-02": "L4 spot zone-b inference " + spot,
		"l4-03": "L4 spot zone-b inference " + spot, "l4-04": "L4 spot zone-b inference " + spot,
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("default machines (-want +got):\n%s", d)
	}
	gpus := 0
	for _, c := range f.Configs(nodeagent.DefaultConfig()) {
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", c.NodeID, err)
		}
		gpus += c.GPUCount
	}
	if gpus != 2*8+2*8+4*4 {
		t.Fatalf("default fleet has %d GPUs", gpus)
	}
}

// The deploy file is what `make run` uses; it must say what Default says.
func TestDeployedDefaultMatches(t *testing.T) {
	path := filepath.Join("..", "..", "..", "deploy", "fleet", "default.yaml")
	if _, err := os.Stat(path); err != nil {
		t.Skipf("no deploy tree here (module built alone): %v", err)
	}
	f, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(Default(), f); d != "" {
		t.Fatalf("deploy/fleet/default.yaml differs from Default() (-Default +file):\n%s", d)
	}
}

func TestParseReportsEveryProblem(t *testing.T) {
	_, err := Parse([]byte(`
machineTypes:
  l4x4: {gpuModel: L4, gpuCount: 4, nvlink: true}
  h200x0: {gpuModel: H200-141GB, gpuCount: 0}
  weird: {gpuModel: B300, gpuCount: 8}
pools:
  - {name: l4, machineType: l4x4, count: 2, priceClass: cheap}
  - {name: l4, machineType: l4x4, count: -1}
  - {name: Bad_Pool, machineType: missing, count: 1}
  - {name: spot, machineType: l4x4, count: 1, purpose: "not an id", taints: [spot, "x:NoExecute"]}
  - {name: twice, machineType: l4x4, count: 1, taints: ["k=a:NoSchedule", "k=b:NoSchedule", "k:PreferNoSchedule"]}
`))
	if err == nil {
		t.Fatal("Parse accepted a broken fleet")
	}
	for _, want := range []string{
		`"l4x4": nvlink: L4 is a PCIe card`,
		`"h200x0": gpuCount is 0`,
		`"weird": unknown GPU model "B300"`,
		`pool 0 ("l4"): price class "cheap"`,
		`pool 1 ("l4"): duplicate pool name`,
		`pool 1 ("l4"): count is -1`,
		`pool 2 ("Bad_Pool"): invalid pool`,
		`pool 2 ("Bad_Pool"): unknown machine type "missing"`,
		`pool 3 ("spot"): taint "spot": want key[=value]:NoSchedule`,
		`pool 3 ("spot"): taint x:NoExecute: effect "NoExecute"`,
		`pool 3 ("spot"): purpose:`,
		`pool 4 ("twice"): taint k=b:NoSchedule: key "k" with effect NoSchedule given twice`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q:\n%v", want, err)
		}
	}
}

func TestParseRefusesUnknownFieldsAndEmptyInput(t *testing.T) {
	for name, doc := range map[string]string{
		"misspelt key": "pools:\n  - {name: a, machineType: t, count: 1, zome: z}\nmachineTypes:\n  t: {gpuModel: T4, gpuCount: 1}\n",
		"empty":        "",
		"no pools":     "machineTypes:\n  t: {gpuModel: T4, gpuCount: 1}\n",
		"not yaml":     "pools: [",
	} {
		if _, err := Parse([]byte(doc)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestNodeIDsWidenForLargePools(t *testing.T) {
	f := Fleet{
		MachineTypes: map[string]MachineType{"t4": {GPUModel: "T4", GPUCount: 1}},
		Pools:        []Pool{{Name: "t4", MachineType: "t4", Count: 120}, {Name: "spare", MachineType: "t4", Count: 0}},
	}
	if err := f.Validate(); err != nil {
		t.Fatal(err)
	}
	ms := f.Machines()
	if len(ms) != 120 || ms[0].NodeID != "t4-001" || ms[119].NodeID != "t4-120" {
		t.Fatalf("%d machines, first %s, last %s", len(ms), ms[0].NodeID, ms[len(ms)-1].NodeID)
	}
}

func TestConfigsApplyTheTemplate(t *testing.T) {
	f := Default()
	template := nodeagent.Config{NodeID: "ignored", GPUModel: "T4", GPUCount: 1, HeartbeatInterval: time.Second,
		StopGrace: 3 * time.Second, LogDir: "/var/log/gpuplane", Labels: map[string]string{"tier": "any", "site": "lab"},
		Purpose: "any", Taints: []contracts.Taint{
			{Key: "gpuplane.io/spot", Value: "maybe", Effect: contracts.TaintPreferNoSchedule}, // the pool's replaces it
			{Key: "site", Value: "lab", Effect: contracts.TaintNoSchedule},
		}}
	cfgs := f.Configs(template)
	if len(cfgs) != 8 {
		t.Fatalf("%d configs", len(cfgs))
	}
	c := cfgs[5] // l4-02
	got := []any{c.NodeID, c.Hostname, c.Pool, c.Zone, c.MachineType, c.PriceClass, c.GPUModel, c.GPUCount, c.NVLink,
		c.CPUMilli, c.MemoryMiB, c.HeartbeatInterval, c.StopGrace, c.LogDir, c.Labels, c.Purpose, c.Taints}
	want := []any{"l4-02", "l4-02", "l4", "zone-b", "pcie-l4-4", "spot", "L4", 4, false,
		int64(48000), int64(196608), time.Second, 3 * time.Second, filepath.Join("/var/log/gpuplane", "l4-02"),
		map[string]string{"tier": "inference", "site": "lab"}, "inference", []contracts.Taint{
			{Key: "site", Value: "lab", Effect: contracts.TaintNoSchedule},
			{Key: "gpuplane.io/spot", Value: "true", Effect: contracts.TaintPreferNoSchedule}}}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("l4-02 config (-want +got):\n%s", d)
	}
	if template.Labels["tier"] != "any" || template.Taints[0].Value != "maybe" {
		t.Fatal("Configs changed the template's labels or taints")
	}
	if h := cfgs[0]; h.Purpose != "training" || len(h.Taints) != 2 || h.Taints[0].Key != "gpuplane.io/spot" {
		t.Fatalf("h100-01: purpose %q, taints %v: want training and the template's taints", h.Purpose, h.Taints)
	}
}
