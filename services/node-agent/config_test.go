package nodeagent

import (
	"flag"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestDefaultConfigIsValid(t *testing.T) {
	c := DefaultConfig()
	c.NodeID = "node-1" // the host name of a test machine may not be an ID
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.HeartbeatInterval != 2*time.Second || c.TelemetryInterval != time.Second || c.StopGrace != 10*time.Second {
		t.Fatalf("intervals %s/%s, grace %s", c.HeartbeatInterval, c.TelemetryInterval, c.StopGrace)
	}
}

func TestValidateReportsEveryProblem(t *testing.T) {
	c := Config{
		NodeID: "bad.node", Pool: "Bad Pool", PriceClass: "cheap", GPUModel: "L4", GPUCount: 99, NVLink: true,
		Labels:            map[string]string{"": "x"},
		HeartbeatInterval: -time.Second, TelemetryInterval: -time.Second, StopGrace: -1, CPUMilli: -1, MemoryMiB: -1,
	}
	err := c.Validate()
	if err == nil {
		t.Fatal("Validate accepted a broken config")
	}
	for _, want := range []string{"node ID", "pool", "price class", "nvlink", "gpu count", "label name",
		"heartbeat interval", "telemetry interval", "stop grace", "cpu", "memory"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	c = Config{NodeID: "n1", Pool: "p", GPUModel: "H100", GPUCount: 1}
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "unknown GPU model") {
		t.Errorf("unknown model: %v", err)
	}
}

func TestZeroSettingsTakeDefaults(t *testing.T) {
	c := Config{NodeID: "n1", Pool: "p", GPUModel: "T4", GPUCount: 2}.withDefaults()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.HeartbeatInterval != DefaultHeartbeatInterval || c.TelemetryInterval != DefaultTelemetryInterval ||
		c.StopGrace != DefaultStopGrace || c.SimLogDelay != DefaultSimLogDelay || c.Now == nil || c.Hostname != "n1" || c.MachineType != "sim-t4-x2" {
		t.Fatalf("defaults not applied: %+v", c)
	}
}

func TestFlags(t *testing.T) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("node-agent", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	err := fs.Parse([]string{"-node-id", "l4-07", "-pool", "l4", "-gpu-model", "L4", "-gpu-count", "4", "-nvlink=false",
		"-labels", "tier=inference,spot=yes", "-telemetry-interval", "250ms", "-nats", "nats://example:4222",
		"-mps-control", "/opt/cuda/bin/nvidia-cuda-mps-control", "-mps-dir", "/run/mps", "-runc", "/opt/runc/bin/runc"})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	got := []any{c.NodeID, c.Pool, c.GPUModel, c.GPUCount, c.NVLink, c.Labels, c.TelemetryInterval, c.Bus.NATSURL,
		c.MPSControl, c.MPSDir, c.Runc}
	want := []any{"l4-07", "l4", "L4", 4, false, map[string]string{"tier": "inference", "spot": "yes"}, 250 * time.Millisecond, "nats://example:4222",
		"/opt/cuda/bin/nvidia-cuda-mps-control", "/run/mps", "/opt/runc/bin/runc"}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("flags (-want +got):\n%s", d)
	}
	if err := fs.Parse([]string{"-labels", "novalue"}); err == nil {
		t.Fatal("a label without '=' was accepted")
	}
}

func TestPlacementFlags(t *testing.T) {
	c := DefaultConfig()
	c.NodeID = "l4-07"
	fs := flag.NewFlagSet("node-agent", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	err := fs.Parse([]string{"-zone", "eu-west-1b", "-purpose", "inference", "-labels", "tier=inference",
		"-label", "rack=r12", "-label", "gpu.vendor=nvidia", "-taint", "gpuplane.io/spot=true:NoSchedule",
		"-taint", "team-ml:PreferNoSchedule", "-price-class", "spot"})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	got := []any{c.Zone, c.Purpose, c.Labels, c.Taints, c.PriceClass}
	want := []any{"eu-west-1b", "inference", map[string]string{"tier": "inference", "rack": "r12", "gpu.vendor": "nvidia"},
		[]contracts.Taint{{Key: "gpuplane.io/spot", Value: "true", Effect: contracts.TaintNoSchedule},
			{Key: "team-ml", Effect: contracts.TaintPreferNoSchedule}}, "spot"}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("flags (-want +got):\n%s", d)
	}
	for _, bad := range [][]string{{"-label", "novalue"}, {"-label", "=v"}, {"-taint", "spot=true"},
		{"-taint", "spot=true:NoExecute"}, {"-taint", ":NoSchedule"}, {"-taint", "a=b=c:NoSchedule"}} {
		if err := fs.Parse(bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

func TestTaintRoundTrip(t *testing.T) {
	for _, s := range []string{"k:NoSchedule", "k=v:PreferNoSchedule", "gpuplane.io/dedicated=team-a:NoSchedule"} {
		tn, err := ParseTaint(s)
		if err != nil {
			t.Fatalf("ParseTaint(%q): %v", s, err)
		}
		if got := FormatTaint(tn); got != s {
			t.Errorf("FormatTaint(ParseTaint(%q)) = %q", s, got)
		}
	}
}

func TestValidatePlacementSettings(t *testing.T) {
	c := DefaultConfig()
	c.NodeID = "n1"
	c.Purpose = "batch inference"
	c.Labels = map[string]string{"k": strings.Repeat("v", contracts.MaxLabelBytes)}
	c.Taints = []contracts.Taint{{Key: "spot", Effect: contracts.TaintNoSchedule}, {Key: "spot", Value: "yes", Effect: contracts.TaintNoSchedule},
		{Key: "x", Effect: "NoExecute"}, {Effect: contracts.TaintNoSchedule}}
	err := c.Validate()
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{"purpose", `label "k" is longer`, `key "spot" with effect NoSchedule given twice`,
		`effect "NoExecute"`, `key "" is empty`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q:\n%v", want, err)
		}
	}
}

func TestBackendKind(t *testing.T) {
	tests := []struct {
		name        string
		args        []string
		env         string // GPUPLANE_NODE_BACKEND
		kind        string
		invalid     string // a word the validation error says; "" for valid
		machineType string // after withDefaults
	}{
		{"default is sim", nil, "", BackendSim, "", "sim-h100-80gb-x8"},
		{"environment", nil, "nvml", BackendNVML, "", ""},
		{"flag over environment", []string{"-backend", "sim"}, "nvml", BackendSim, "", "sim-h100-80gb-x8"},
		// The simulated machine's shape is not checked for nvml: the GPUs
		// are whatever the machine has.
		{"nvml ignores the simulated shape", []string{"-backend", "nvml", "-gpu-model", "nope", "-gpu-count", "0"}, "", BackendNVML, "", ""},
		{"unknown backend", []string{"-backend", "cuda"}, "", "cuda", `backend "cuda"`, "sim-h100-80gb-x8"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("GPUPLANE_NODE_BACKEND", tc.env)
			c := DefaultConfig()
			c.NodeID = "node-1"
			fs := flag.NewFlagSet("node-agent", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			c.RegisterFlags(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			if c.BackendKind != tc.kind {
				t.Errorf("backend %q; want %q", c.BackendKind, tc.kind)
			}
			err := c.Validate()
			switch {
			case tc.invalid == "" && err != nil:
				t.Errorf("Validate: %v", err)
			case tc.invalid != "" && (err == nil || !strings.Contains(err.Error(), tc.invalid)):
				t.Errorf("Validate: %v; want an error saying %s", err, tc.invalid)
			}
			if mt := c.withDefaults().MachineType; mt != tc.machineType {
				t.Errorf("machine type %q; want %q (an nvml agent names it after its GPUs)", mt, tc.machineType)
			}
		})
	}
}

func TestSimulatedMachineShapeFlags(t *testing.T) {
	c := DefaultConfig()
	c.NodeID = "h100p-01"
	fs := flag.NewFlagSet("node-agent", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"-gpu-model", "H100-80GB-PCIE", "-nvlink=false", "-nvlink-bridges", "-mig-layout", "3g.40gb, 4g.40gb"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if !c.NVLinkBridges || !c.MIGEnabled || !slices.Equal(c.MIGLayout, []string{"3g.40gb", "4g.40gb"}) {
		t.Fatalf("bridges %v, MIG %v %v", c.NVLinkBridges, c.MIGEnabled, c.MIGLayout)
	}
	for name, c := range map[string]Config{
		"bridges on an SXM card": {GPUModel: "H100-80GB", NVLinkBridges: true},
		"MIG on an L4":           {GPUModel: "L4", MIGEnabled: true},
		"a layout too big":       {GPUModel: "A100-40GB", MIGEnabled: true, MIGLayout: []string{"7g.40gb", "1g.5gb"}},
	} {
		c.NodeID, c.Pool, c.GPUCount = "n1", "p", 8
		err := c.Validate()
		if err == nil {
			t.Errorf("%s: accepted", name)
		} else if !strings.Contains(err.Error(), "bridges") && !strings.Contains(err.Error(), "mig") {
			t.Errorf("%s: %v", name, err)
		}
	}
}
