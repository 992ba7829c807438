package fleet_test

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	nodeagent "github.com/gpuplane/gpuplane/services/node-agent"
	"github.com/gpuplane/gpuplane/services/node-agent/fleet"
)

func TestMachineTypeNVLinkAndMIGOptions(t *testing.T) {
	f, err := fleet.Parse([]byte(`
machineTypes:
  h100-pcie-8: {gpuModel: H100-80GB-PCIE, gpuCount: 8, nvlink: pairs}
  hgx-a100-mig: {gpuModel: A100-80GB, gpuCount: 8, nvlink: true, mig: {enabled: true, layout: ["3g.40gb", "3g.40gb"]}}
  hgx-h100-mig-empty: {gpuModel: H100-80GB, gpuCount: 8, nvlink: true, mig: {enabled: true}}
  l4x2: {gpuModel: L4, gpuCount: 2, nvlink: false}
pools:
  - {name: pcie, machineType: h100-pcie-8, count: 1}
  - {name: mig, machineType: hgx-a100-mig, count: 1}
  - {name: empty, machineType: hgx-h100-mig-empty, count: 1}
  - {name: l4, machineType: l4x2, count: 1}
`))
	if err != nil {
		t.Fatal(err)
	}
	byNode := map[string]nodeagent.Config{}
	for _, c := range f.Configs(nodeagent.Config{}) {
		byNode[c.NodeID] = c
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", c.NodeID, err)
		}
	}
	for node, want := range map[string]struct {
		nvlink, bridges, mig bool
		layout               []string
	}{
		"pcie-01":  {false, true, false, nil},
		"mig-01":   {true, false, true, []string{"3g.40gb", "3g.40gb"}},
		"empty-01": {true, false, true, nil},
		"l4-01":    {false, false, false, nil},
	} {
		c := byNode[node]
		if c.NVLink != want.nvlink || c.NVLinkBridges != want.bridges || c.MIGEnabled != want.mig || !slices.Equal(c.MIGLayout, want.layout) {
			t.Errorf("%s: nvlink %v, bridges %v, MIG %v %v; want %+v", node, c.NVLink, c.NVLinkBridges, c.MIGEnabled, c.MIGLayout, want)
		}
	}
	// Configs hand out copies: one machine's layout is not another's.
	byNode["mig-01"].MIGLayout[0] = "changed"
	if f.MachineTypes["hgx-a100-mig"].MIG.Layout[0] != "3g.40gb" {
		t.Error("a machine's config shares its layout with the fleet description")
	}
}

func TestMachineTypeOptionsAreValidated(t *testing.T) {
	for name, c := range map[string]struct {
		doc  string
		want string
	}{
		"pairs on a card without bridges": {`{gpuModel: L40S, gpuCount: 2, nvlink: pairs}`, `"t": nvlink: pairs: L40S takes no NVLink bridges`},
		"nvlink neither bool nor pairs":   {`{gpuModel: H100-80GB, gpuCount: 8, nvlink: all}`, `nvlink is "all"; want true`},
		"MIG on a V100":                   {`{gpuModel: V100-32GB, gpuCount: 8, mig: {enabled: true}}`, `V100-32GB has no MIG`},
		"a layout that does not fit":      {`{gpuModel: A100-80GB, gpuCount: 8, mig: {enabled: true, layout: [4g.40gb, 4g.40gb]}}`, `needs 8 compute`},
		"another model's profile":         {`{gpuModel: H200-141GB, gpuCount: 8, mig: {enabled: true, layout: [1g.10gb]}}`, `unknown MIG profile "1g.10gb" for H200-141GB`},
		"a layout with MIG off":           {`{gpuModel: A100-40GB, gpuCount: 8, mig: {layout: [7g.40gb]}}`, `MIG is not enabled`},
		"a misspelt machine type key":     {`{gpuModel: T4, gpuCount: 1, nvlnk: true}`, `unknown field "nvlnk" in machine type`},
		"a misspelt mig key":              {`{gpuModel: A100-40GB, gpuCount: 1, mig: {enable: true}}`, `unknown field "enable" in mig`},
		"a wrong type":                    {`{gpuModel: T4, gpuCount: many}`, `cannot unmarshal`},
	} {
		_, err := fleet.Parse([]byte("machineTypes:\n  t: " + c.doc + "\npools:\n  - {name: p, machineType: t, count: 1}\n"))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v; want an error saying %q", name, err, c.want)
		}
	}
}

// TestDeadMachineStaysDeadAndTheFleetGoesOn: a machine_death fault ends
// one agent; the fleet neither stops nor restarts it.
func TestDeadMachineStaysDeadAndTheFleetGoesOn(t *testing.T) {
	bs := fleet.ConnectBuses(t)
	b := bs.Op
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	f, err := fleet.Parse([]byte(`
machineTypes:
  t4: {gpuModel: T4, gpuCount: 1}
pools:
  - {name: t4, machineType: t4, count: 2}
`))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	beats := map[string][]contracts.Heartbeat{}
	go func() {
		_ = b.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamHeartbeats, FilterSubjects: []string{contracts.SubjectHeartbeatAll}},
			func(_ context.Context, m *bus.Msg) error {
				var hb contracts.Heartbeat
				if m.Decode(&hb) == nil {
					mu.Lock()
					beats[hb.NodeID] = append(beats[hb.NodeID], hb)
					mu.Unlock()
				}
				return nil
			}, nil)
	}()
	count := func(node string) (n int, incarnations int) {
		mu.Lock()
		defer mu.Unlock()
		seen := map[string]bool{}
		for _, hb := range beats[node] {
			seen[hb.Incarnation] = true
		}
		return len(beats[node]), len(seen)
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- fleet.Run(runCtx, f, bs.Fleet, nodeagent.Config{HeartbeatInterval: 100 * time.Millisecond,
			TelemetryInterval: 100 * time.Millisecond, LogDir: t.TempDir()}, slog.New(slog.NewTextHandler(t.Output(), nil)))
	}()
	waitFor("both machines' heartbeats", func() bool { a, _ := count("t4-01"); c, _ := count("t4-02"); return a >= 2 && c >= 2 })

	fault := contracts.Fault{ID: "death-1", Kind: contracts.FaultMachineDeath}
	if _, err := b.Publish(ctx, contracts.SubjectNodeCommands("t4-01"), contracts.FaultCommandID("t4-01", fault.ID),
		contracts.NodeCommand{SchemaVersion: contracts.SchemaVersion, Kind: contracts.CommandInjectFault, Fault: &fault, Time: time.Now()}); err != nil {
		t.Fatal(err)
	}
	var dead int
	waitFor("t4-01 silent", func() bool {
		n, _ := count("t4-01")
		same := n == dead
		dead = n
		time.Sleep(300 * time.Millisecond) // three heartbeat intervals
		return same
	})
	alive, _ := count("t4-02")
	waitFor("t4-02 still beating", func() bool { n, _ := count("t4-02"); return n >= alive+5 })
	if n, incarnations := count("t4-01"); n != dead || incarnations != 1 {
		t.Fatalf("t4-01 after its death: %d heartbeats (then %d), %d incarnations; want silence and no restart", n, dead, incarnations)
	}
	select {
	case err := <-done:
		t.Fatalf("fleet.Run returned %v when one machine died", err)
	default:
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("fleet.Run: %v", err)
	}
}
