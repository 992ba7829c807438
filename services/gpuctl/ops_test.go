package gpuctl

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// runJob publishes the events of acme/id up to running attempt 1 on
// node-1 and waits until the gateway answers it is running.
func (h *harness) runJob(id string) {
	h.t.Helper()
	req := contracts.JobRequest{ID: id, Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}, Run: contracts.RunSpec{Duration: contracts.Duration(time.Minute), Checkpoint: true}}
	now := time.Now()
	h.queue(req, now)
	placement := &contracts.Placement{AllocationID: contracts.AllocationID("acme", id, 1), NodeID: "node-1", Pool: "p", Devices: []contracts.DeviceRef{{Index: 0}}}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: "acme", JobID: id, Attempt: 1, Time: now, Placement: placement})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, State: contracts.StateRunning, Tenant: "acme", JobID: id, Attempt: 1, Time: now})
	h.eventually("job "+id+" running", func() bool {
		_, out, _ := h.run("get", id)
		return strings.Contains(out, "running")
	})
}

// chunk publishes a piece of the output of acme/id attempt 1, as the node
// agent does.
func (h *harness) chunk(id string, off int64, data string, eof bool, exit int) {
	h.t.Helper()
	alloc := contracts.AllocationID("acme", id, 1)
	c := contracts.LogChunk{SchemaVersion: contracts.SchemaVersion, AllocationID: alloc, Tenant: "acme", JobID: id, Attempt: 1,
		NodeID: "node-1", Offset: off, Data: data, EOF: eof, ExitCode: exit, Time: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectLogs("acme", id, "n1"), contracts.LogChunkID(alloc, off, eof), c); err != nil {
		h.t.Fatal(err)
	}
}

func TestLogs(t *testing.T) {
	h := start(t)
	h.runJob("j1")
	h.chunk("j1", 6, "world\n", false, 0)
	h.chunk("j1", 0, "hello ", false, 0)

	// The run is still going: what it wrote so far, exit 0, no exit code.
	code, out, errOut := h.run("logs", "j1")
	if code != ExitOK || out != "hello world\n" || errOut != "" {
		t.Fatalf("logs: code %d stdout %q stderr %q", code, out, errOut)
	}

	// Following: the rest arrives while gpuctl runs, and it stops by
	// itself at the end of the output, exit code on stderr.
	stdout, wait := h.runAsync("logs", "-f", "j1")
	h.eventually("the output so far", func() bool { return stdout.String() == "hello world\n" })
	h.chunk("j1", 12, "bye\n", false, 0)
	h.eventually("the new line", func() bool { return stdout.String() == "hello world\nbye\n" })
	h.chunk("j1", 16, "", true, 3)
	code, errOut = wait()
	if code != ExitOK || stdout.String() != "hello world\nbye\n" || errOut != "gpuctl logs: attempt 1 exited with code 3\n" {
		t.Fatalf("logs -f: code %d stdout %q stderr %q", code, stdout.String(), errOut)
	}

	code, out, errOut = h.run("logs", "j1", "--attempt", "all")
	if code != ExitOK || out != "hello world\nbye\n" || errOut != "gpuctl logs: the run exited with code 3\n" {
		t.Fatalf("logs --attempt all: code %d stdout %q stderr %q", code, out, errOut)
	}
	for name, tt := range map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"unknown job":   {[]string{"logs", "ghost"}, ExitError, "unknown_job"},
		"no attempt 2":  {[]string{"logs", "j1", "--attempt", "2"}, ExitError, "out_of_range"},
		"bad attempt":   {[]string{"logs", "j1", "--attempt", "last"}, ExitUsage, "--attempt"},
		"two jobs":      {[]string{"logs", "a", "b"}, ExitUsage, "exactly one job ID"},
		"bad job ID":    {[]string{"logs", "a.b"}, ExitUsage, "invalid id"},
		"without an ID": {[]string{"logs", "-f"}, ExitUsage, "exactly one job ID"},
	} {
		if code, _, errOut := h.run(tt.args...); code != tt.code || !strings.Contains(errOut, tt.stderr) {
			t.Errorf("%s: code %d stderr %q; want %d and %q", name, code, errOut, tt.code, tt.stderr)
		}
	}
}

// TestLogsFollowOfALostRun: the job failed long ago and its run's output
// has no end (its node died): -f prints what there is and says so.
func TestLogsFollowOfALostRun(t *testing.T) {
	h := start(t)
	h.runJob("lost")
	h.chunk("lost", 0, "partial", false, 0)
	h.publishEvent(contracts.JobEvent{Type: contracts.EventFailed, State: contracts.StateFailed, Tenant: "acme", JobID: "lost", Attempt: 1,
		Time: time.Now().Add(-time.Hour), Reason: contracts.ReasonNodeLost})
	h.eventually("job lost failed", func() bool { _, out, _ := h.run("get", "lost"); return strings.Contains(out, "failed") })
	code, out, errOut := h.run("logs", "-f", "lost")
	if code != ExitError || out != "partial" || !strings.Contains(errOut, "without its end-of-output mark") {
		t.Fatalf("logs -f: code %d stdout %q stderr %q", code, out, errOut)
	}
}

func TestCheckpoint(t *testing.T) {
	h := start(t)
	h.runJob("j1")
	code, out, errOut := h.run("checkpoint", "j1")
	if code != ExitOK || out != "checkpoint requested for job j1 (attempt 1 on node node-1)\n" {
		t.Fatalf("checkpoint: code %d stdout %q stderr %q", code, out, errOut)
	}
	cmds := h.commands()
	if len(cmds) != 1 || cmds[0].Subject != contracts.SubjectNodeCommands("node-1") ||
		!strings.HasPrefix(cmds[0].ID(), "cmd/checkpoint_run/"+contracts.AllocationID("acme", "j1", 1)+"/") {
		t.Fatalf("commands on the bus: %d", len(cmds))
	}
	h.queue(contracts.JobRequest{ID: "waiting", Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1}}}, time.Now())
	h.eventually("job waiting known", func() bool { code, _, _ := h.run("get", "waiting"); return code == ExitOK })
	if code, _, errOut := h.run("checkpoint", "waiting"); code != ExitError || !strings.Contains(errOut, "not_running") {
		t.Fatalf("checkpoint of a queued job: code %d stderr %q", code, errOut)
	}
	if code, _, errOut := h.run("checkpoint", "ghost"); code != ExitError || !strings.Contains(errOut, "unknown_job") {
		t.Fatalf("checkpoint of an unknown job: code %d stderr %q", code, errOut)
	}
}

func (h *harness) commands() []*bus.Msg {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	var got []*bus.Msg
	if _, err := h.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamNodeCommands}, func(_ context.Context, m *bus.Msg) error {
		got = append(got, m)
		return nil
	}); err != nil {
		h.t.Fatal(err)
	}
	return got
}

// h100 is an 8-GPU H100 SXM machine: NVSwitch, 18 links between any two,
// MIG on GPU 7.
func h100(node string) contracts.NodeInventory {
	inv := contracts.NodeInventory{SchemaVersion: contracts.SchemaVersion, NodeID: node, Hostname: node, Pool: "h100", Zone: "zone-a",
		MachineType: "h100-sxm-8", PriceClass: "spot", Backend: "sim", DriverVersion: "550.54.15", CUDAVersion: "12.4",
		CPUMilli: 192000, MemoryMiB: 2048 * 1024, Incarnation: "inc-1", Time: time.Now().UTC()}
	for i := range 8 {
		g := contracts.GPUInfo{Index: i, UUID: "GPU-" + node + "-" + strconv.Itoa(i), Model: "H100-80GB", MemoryMiB: 81559,
			PCIBusID: "00000000:" + strconv.Itoa(10+i) + ":00.0", Healthy: i != 3, ComputeCapability: "9.0"}
		for j := i + 1; j < 8; j++ {
			inv.Topology = append(inv.Topology, contracts.GPULink{A: i, B: j, NVLinks: 18, Path: contracts.TopoSystem})
		}
		inv.GPUs = append(inv.GPUs, g)
	}
	inv.GPUs[7].MIGEnabled = true
	inv.GPUs[7].MIGInstances = []contracts.MIGInstance{
		{UUID: "MIG-a", Profile: "3g.40gb", GIID: 1, CIID: 0, Start: 0, Size: 4, MemoryMiB: 40192},
		{UUID: "MIG-b", Profile: "3g.40gb", GIID: 2, CIID: 0, Start: 4, Size: 4, MemoryMiB: 40192},
	}
	return inv
}

func (h *harness) inventory(inv contracts.NodeInventory) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectInventory(inv.NodeID), contracts.InventoryID(inv.NodeID, inv.Incarnation, 1), inv); err != nil {
		h.t.Fatal(err)
	}
}

func TestNodes(t *testing.T) {
	h := start(t)
	h.inventory(h100("h100-01"))
	l4 := contracts.NodeInventory{SchemaVersion: 1, NodeID: "l4-01", Pool: "l4", MachineType: "l4-pcie-4", Backend: "nvml",
		Incarnation: "i", GPUs: []contracts.GPUInfo{{Index: 0, Model: "L4", Healthy: true}, {Index: 1, Model: "L4", Healthy: true},
			{Index: 2, Model: "L4", Healthy: true}, {Index: 3, Model: "L4", Healthy: true}}}
	for a := range 4 {
		for b := a + 1; b < 4; b++ {
			path := contracts.TopoSystem
			if b == a+1 && a%2 == 0 {
				path = contracts.TopoSingle
			}
			l4.Topology = append(l4.Topology, contracts.GPULink{A: a, B: b, Path: path})
		}
	}
	h.inventory(l4)
	var out string
	h.eventually("two nodes listed", func() bool { _, out, _ = h.run("nodes"); return strings.Count(out, "\n") == 3 })
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i, want := range [][]string{
		{"NODE", "POOL", "MACHINE", "BACKEND", "STATE", "SCHEDULING", "GPUS", "HEALTHY", "MIG", "DRIVER", "CUDA", "TOPOLOGY", "ZONE", "TAINTS"},
		{"h100-01", "h100", "h100-sxm-8", "sim", "-", "schedulable", "8 × H100-80GB", "7/8", "2 instances on 1 GPU", "550.54.15", "12.4",
			"NVLink all-to-all, 18 links", "zone-a", "-"},
		{"l4-01", "l4", "l4-pcie-4", "nvml", "-", "schedulable", "4 × L4", "4/4", "-", "-", "-", "PCIe pairs", "-", "-"},
	} {
		if got := strings.Split(strings.TrimSpace(regexpSpaces(lines[i])), "  "); !cmp.Equal(got, want) {
			t.Errorf("line %d: %q, want %q", i, got, want)
		}
	}
	code, out, errOut := h.run("nodes", "h100-01")
	if code != ExitOK {
		t.Fatalf("nodes h100-01: %d %s", code, errOut)
	}
	if strings.Contains(out, "Labels:") {
		t.Errorf("a node without labels shows a Labels line:\n%s", out)
	}
	for _, want := range []string{"Driver:", "550.54.15", "CUDA:", "12.4", "Topology:", "NVLink all-to-all, 18 links",
		"8 × H100-80GB, 7/8 healthy", "CPU:", "192 cores", "UNHEALTHY", "9.0", "on, 2 instances",
		"3g.40gb", "MIG-b", "4:4", "GPU0", "NV18"} {
		if !strings.Contains(out, want) {
			t.Errorf("nodes h100-01 lacks %q:\n%s", want, out)
		}
	}
	if code, out, _ := h.run("nodes", "--pool", "l4", "-o", "json"); code != ExitOK || !strings.Contains(out, `"nodeId": "l4-01"`) || strings.Contains(out, "h100-01") {
		t.Fatalf("nodes --pool l4 -o json: %d %s", code, out)
	}
	if code, _, errOut := h.run("nodes", "ghost"); code != ExitError || !strings.Contains(errOut, "unknown_node") {
		t.Fatalf("nodes ghost: %d %q", code, errOut)
	}
}

// regexpSpaces turns every run of two or more spaces into exactly two,
// so a table row splits into its cells.
func regexpSpaces(s string) string {
	for strings.Contains(s, "   ") {
		s = strings.ReplaceAll(s, "   ", "  ")
	}
	return s
}

func TestFaultInject(t *testing.T) {
	h := start(t)
	h.inventory(h100("h100-01"))
	h.eventually("node known", func() bool { code, _, _ := h.run("nodes", "h100-01"); return code == ExitOK })
	code, out, errOut := h.run("fault", "inject", "h100-01", "--kind", "xid", "--gpu", "3", "--code", "79")
	if code != ExitOK || !strings.HasPrefix(out, "fault ") || !strings.HasSuffix(out, " (xid 79 on GPU 3) sent to node h100-01\n") {
		t.Fatalf("fault inject: code %d stdout %q stderr %q", code, out, errOut)
	}
	faultID := strings.Fields(out)[1]
	code, out, errOut = h.run("fault", "inject", "h100-01", "--kind", "agent_pause", "--duration", "45s", "-o", "json")
	if code != ExitOK || !strings.Contains(out, `"kind": "agent_pause"`) || !strings.Contains(out, `"duration": "45s"`) {
		t.Fatalf("fault inject -o json: code %d stdout %q stderr %q", code, out, errOut)
	}
	cmds := h.commands()
	if len(cmds) != 2 || cmds[0].Subject != contracts.SubjectNodeCommands("h100-01") || cmds[0].ID() != contracts.FaultCommandID("h100-01", faultID) {
		t.Fatalf("%d commands; the first on %s with ID %q, want %s", len(cmds), cmds[0].Subject, cmds[0].ID(), contracts.FaultCommandID("h100-01", faultID))
	}
	var cmd contracts.NodeCommand
	if err := cmds[1].Decode(&cmd); err != nil {
		t.Fatal(err)
	}
	if cmd.Kind != contracts.CommandInjectFault || cmd.Fault == nil || cmd.Fault.Kind != contracts.FaultAgentPause || cmd.Fault.Duration.D() != 45*time.Second {
		t.Fatalf("second command %+v", cmd)
	}

	for name, tt := range map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"no inject":         {[]string{"fault", "h100-01", "--kind", "xid"}, ExitUsage, "fault inject NODE"},
		"no node":           {[]string{"fault", "inject", "--kind", "xid"}, ExitUsage, "fault inject NODE"},
		"no kind":           {[]string{"fault", "inject", "h100-01"}, ExitUsage, "--kind is required"},
		"unknown kind":      {[]string{"fault", "inject", "h100-01", "--kind", "meteor"}, ExitUsage, `--kind "meteor"`},
		"bad duration":      {[]string{"fault", "inject", "h100-01", "--kind", "overheat", "--duration", "soon"}, ExitUsage, "--duration"},
		"bad node":          {[]string{"fault", "inject", "a.b", "--kind", "xid"}, ExitUsage, "invalid id"},
		"unknown node":      {[]string{"fault", "inject", "ghost", "--kind", "xid"}, ExitError, "unknown_node"},
		"gpu out of range":  {[]string{"fault", "inject", "h100-01", "--kind", "ecc_dbe", "--gpu", "9"}, ExitError, "gpu: out_of_range"},
		"code without xid":  {[]string{"fault", "inject", "h100-01", "--kind", "overheat", "--code", "79"}, ExitError, "code: invalid_value"},
		"gpu on machine":    {[]string{"fault", "inject", "h100-01", "--kind", "machine_death", "--gpu", "1"}, ExitError, "gpu: invalid_value"},
		"duration with ecc": {[]string{"fault", "inject", "h100-01", "--kind", "ecc_dbe", "--duration", "1m"}, ExitError, "duration: invalid_value"},
	} {
		if code, _, errOut := h.run(tt.args...); code != tt.code || !strings.Contains(errOut, tt.stderr) {
			t.Errorf("%s: code %d stderr %q; want %d and %q", name, code, errOut, tt.code, tt.stderr)
		}
	}
	if n := len(h.commands()); n != 2 {
		t.Fatalf("refused faults reached the bus: %d commands, want 2", n)
	}
}

func TestTopologySummary(t *testing.T) {
	all := func(n, links int, path contracts.TopoPath) []contracts.GPULink {
		var out []contracts.GPULink
		for a := range n {
			for b := a + 1; b < n; b++ {
				out = append(out, contracts.GPULink{A: a, B: b, NVLinks: links, Path: path})
			}
		}
		return out
	}
	pairs := func(n, links int, near, far contracts.TopoPath) []contracts.GPULink {
		out := all(n, 0, far)
		for i := range out {
			if out[i].B == out[i].A+1 && out[i].A%2 == 0 {
				out[i].NVLinks, out[i].Path = links, near
			}
		}
		return out
	}
	mixed := all(4, 0, contracts.TopoSystem)
	mixed[0].Path = contracts.TopoNode
	partial := all(4, 0, contracts.TopoSystem)
	partial[0].NVLinks = 4
	partial[1].NVLinks = 4
	uneven := all(4, 12, contracts.TopoSystem)
	uneven[5].NVLinks = 6
	tests := map[string]struct {
		n     int
		links []contracts.GPULink
		want  string
	}{
		"8 × H100 SXM, NVSwitch":   {8, all(8, 18, contracts.TopoSystem), "NVLink all-to-all, 18 links"},
		"A100 SXM, 12 links":       {8, all(8, 12, contracts.TopoNode), "NVLink all-to-all, 12 links"},
		"uneven all-to-all":        {4, uneven, "NVLink all-to-all, 6-12 links"},
		"NVLink bridges in pairs":  {4, pairs(4, 4, contracts.TopoSystem, contracts.TopoSystem), "NVLink pairs, 4 links"},
		"NVLink partial":           {4, partial, "NVLink partial (2 of 6 GPU pairs), 4 links"},
		"PCIe pairs on switches":   {4, pairs(4, 0, contracts.TopoSingle, contracts.TopoSystem), "PCIe pairs"},
		"PCIe pairs, multi switch": {2, pairs(2, 0, contracts.TopoMultiple, contracts.TopoSystem), "PCIe pairs"},
		"PCIe, all across sockets": {4, all(4, 0, contracts.TopoSystem), "PCIe only (SYS)"},
		"PCIe mixed":               {4, mixed, "PCIe mixed"},
		"one GPU":                  {1, nil, "single GPU"},
		"no topology reported":     {8, nil, "-"},
		"no GPUs":                  {0, nil, "-"},
	}
	for name, tt := range tests {
		if got := topologySummary(tt.n, tt.links); got != tt.want {
			t.Errorf("%s: %q, want %q", name, got, tt.want)
		}
	}
}
