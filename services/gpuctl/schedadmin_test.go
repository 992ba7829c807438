package gpuctl

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestSubmitSchedulingFlags(t *testing.T) {
	h := start(t)
	tests := map[string]struct {
		args []string
		want contracts.JobRequest
	}{
		"gang": {
			[]string{"--gpus", "16", "--model", "H100-80GB", "--nodes", "2", "--topology", "nvlink", "--cpu", "96", "--memory", "512Gi",
				"--selector", "zone=a", "--selector", "purpose=training", "--toleration", "spot=true:NoSchedule",
				"--toleration", "gpu-test:Exists,:Exists", "--toleration", "dedicated=research", "--depends-on", "prep,data",
				"--expected", "2h", "--placement-timeout", "30m"},
			contracts.JobRequest{
				Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 16, Model: "H100-80GB", Nodes: 2, Topology: contracts.TopologyNVLink},
					CPUMilli: 96000, MemoryMiB: 512 * 1024},
				NodeSelector: map[string]string{"zone": "a", "purpose": "training"},
				Tolerations: []contracts.Toleration{
					{Key: "spot", Operator: contracts.TolerationEqual, Value: "true", Effect: contracts.TaintNoSchedule},
					{Key: "gpu-test", Operator: contracts.TolerationExists},
					{Operator: contracts.TolerationExists},
					{Key: "dedicated", Operator: contracts.TolerationEqual, Value: "research"},
				},
				DependsOn:        []string{"prep", "data"},
				ExpectedRunTime:  contracts.Duration(2 * time.Hour),
				PlacementTimeout: contracts.Duration(30 * time.Minute),
			},
		},
		"mig": {
			[]string{"--mig", "1g.10gb", "--model", "H100-80GB", "--toleration", "mig:Exists:PreferNoSchedule"},
			contracts.JobRequest{Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: "H100-80GB", MIGProfile: "1g.10gb"}},
				Tolerations: []contracts.Toleration{{Key: "mig", Operator: contracts.TolerationExists, Effect: contracts.TaintPreferNoSchedule}}},
		},
		"share": {
			[]string{"--share", "4Gi:25", "--models", "L4,T4", "--cpu", "500m", "--memory", "8192"},
			contracts.JobRequest{Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: contracts.GPUModelAny,
				Models: []string{"L4", "T4"}, Share: &contracts.GPUShare{MemoryMiB: 4096, ComputePercent: 25}}, CPUMilli: 500, MemoryMiB: 8192}},
		},
		"fractional cores": {
			[]string{"--cpu", "0.25", "--memory", "1Ti"},
			contracts.JobRequest{Resources: contracts.Resources{GPU: contracts.GPURequest{Count: 1, Model: contracts.GPUModelAny},
				CPUMilli: 250, MemoryMiB: 1 << 20}},
		},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			id := strings.ReplaceAll(name, " ", "-")
			args := append([]string{"submit", "--id", id, "--duration", "1m"}, tt.args...)
			if code, out, errOut := h.run(args...); code != ExitOK || !strings.Contains(out, "job "+id+" submitted") {
				t.Fatalf("submit: %d %q %q", code, out, errOut)
			}
			want := tt.want
			want.ID, want.Run = id, contracts.RunSpec{Duration: contracts.Duration(time.Minute)}
			if want.Resources.GPU.Model == "" {
				want.Resources.GPU.Model = contracts.GPUModelAny
			}
			if diff := cmp.Diff(want, h.submitted(id)); diff != "" {
				t.Fatalf("published request (-want +got):\n%s", diff)
			}
		})
	}

	before := len(h.messages(contracts.SubjectSubmitAll))
	refused := map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"share without colon":   {[]string{"--share", "4096"}, ExitUsage, "want MEMORY:PERCENT"},
		"share bad memory":      {[]string{"--share", "lots:25"}, ExitUsage, `memory "lots"`},
		"share bad percent":     {[]string{"--share", "4096:a"}, ExitUsage, `compute percent "a"`},
		"cpu not a number":      {[]string{"--cpu", "lots"}, ExitUsage, `--cpu "lots"`},
		"memory unit":           {[]string{"--memory", "5GB"}, ExitUsage, `memory "5GB"`},
		"toleration key only":   {[]string{"--toleration", "spot"}, ExitUsage, "KEY=VALUE[:EFFECT] or KEY:Exists[:EFFECT]"},
		"toleration bad op":     {[]string{"--toleration", "spot:Maybe"}, ExitUsage, "KEY=VALUE[:EFFECT]"},
		"selector without =":    {[]string{"--selector", "zone"}, ExitUsage, `--selector "zone": want KEY=VALUE`},
		"unknown effect":        {[]string{"--toleration", "spot=true:NoExecute"}, ExitError, "tolerations[0]: invalid_value"},
		"unknown mig profile":   {[]string{"--mig", "9g.1tb"}, ExitError, "resources.gpu.migProfile: invalid_value"},
		"mig of two":            {[]string{"--mig", "1g.10gb", "--gpus", "2"}, ExitError, "resources.gpu.count: out_of_range"},
		"whole gpu as share":    {[]string{"--share", "4096:100"}, ExitError, "resources.gpu.share.computePercent: out_of_range"},
		"uneven gang":           {[]string{"--gpus", "8", "--nodes", "3"}, ExitError, "count 8 does not split evenly over 3 machines"},
		"unknown topology":      {[]string{"--topology", "ring"}, ExitError, "resources.gpu.topology: invalid_value"},
		"model and models":      {[]string{"--model", "L4", "--models", "T4"}, ExitError, "set model or models, not both"},
		"bad expected":          {[]string{"--expected", "soon"}, ExitError, "expectedRunTime: invalid_duration"},
		"placement timeout 8d":  {[]string{"--placement-timeout", "192h"}, ExitError, "placementTimeout: out_of_range"},
		"bad dependency":        {[]string{"--depends-on", "ok,a.b"}, ExitError, "dependsOn: invalid_id"},
		"negative cpu":          {[]string{"--cpu", "-1"}, ExitError, "resources.cpuMilli: out_of_range"},
		"file with scheduling":  {[]string{"-f", "job.yaml", "--mig", "1g.10gb", "--selector", "a=b"}, ExitUsage, "--mig --selector"},
		"depends on itself":     {[]string{"--id", "me", "--depends-on", "me"}, ExitError, "dependsOn: dependency_cycle"},
		"largest gang too wide": {[]string{"--gpus", "258", "--nodes", "129"}, ExitError, "resources.gpu.nodes: out_of_range"},
	}
	for name, tt := range refused {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run(append([]string{"submit"}, tt.args...)...)
			if code != tt.code || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("code %d, stderr %q; want %d and %q", code, errOut, tt.code, tt.stderr)
			}
		})
	}
	if after := len(h.messages(contracts.SubjectSubmitAll)); after != before {
		t.Fatalf("refused submits published %d messages", after-before)
	}
}

// kvGet reads key of bucket as the scheduler does; false when absent.
func (h *harness) kvGet(bucket, key string, v any) bool {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := h.bus.KeyValue(ctx, bucket)
	if err != nil {
		h.t.Fatal(err)
	}
	e, err := kv.Get(ctx, key)
	if err != nil {
		return false
	}
	if err := json.Unmarshal(e.Value(), v); err != nil {
		h.t.Fatal(err)
	}
	return true
}

func TestQuotaCommands(t *testing.T) {
	h := start(t)
	if code, out, errOut := h.run("quota", "get"); code != ExitOK || !strings.Contains(out, "tenant acme has no quota") {
		t.Fatalf("quota get of none: %d %q %q", code, out, errOut)
	}
	steps := []struct {
		args []string
		want contracts.TenantQuota // what KV holds after it, updatedAt aside
	}{
		{[]string{"--pool", "h100", "--guarantee", "8", "--max", "16"},
			contracts.TenantQuota{Pools: map[string]contracts.PoolQuota{"h100": {Guarantee: 8, Max: ptr(16.0)}}}},
		{[]string{"--weight", "2", "--strict-fifo"},
			contracts.TenantQuota{Weight: 2, StrictFIFO: true, Pools: map[string]contracts.PoolQuota{"h100": {Guarantee: 8, Max: ptr(16.0)}}}},
		{[]string{"--pool", "h100", "--max", "none"},
			contracts.TenantQuota{Weight: 2, StrictFIFO: true, Pools: map[string]contracts.PoolQuota{"h100": {Guarantee: 8}}}},
		{[]string{"--guarantee", "0.5", "--strict-fifo=false"},
			contracts.TenantQuota{Weight: 2, Pools: map[string]contracts.PoolQuota{"h100": {Guarantee: 8}, "*": {Guarantee: 0.5}}}},
	}
	for _, st := range steps {
		code, out, errOut := h.run(append([]string{"quota", "set"}, st.args...)...)
		if code != ExitOK || !strings.Contains(out, "TENANT") || !strings.Contains(out, "acme") {
			t.Fatalf("quota set %v: %d %q %q", st.args, code, out, errOut)
		}
		var got contracts.TenantQuota
		if !h.kvGet(contracts.BucketQuotas, "acme", &got) {
			t.Fatalf("quota set %v: nothing in KV", st.args)
		}
		want := st.want
		want.SchemaVersion, want.Tenant, want.UpdatedAt = contracts.SchemaVersion, "acme", got.UpdatedAt
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("after quota set %v (-want +got):\n%s", st.args, diff)
		}
	}
	_, out, _ := h.run("quota", "get")
	for _, want := range []string{"acme", "2", "fair", "*", "0.5", "h100", "8", "-"} {
		if !strings.Contains(out, want) {
			t.Errorf("quota get lacks %q:\n%s", want, out)
		}
	}
	code, out, _ := h.run("quota", "get", "-o", "json")
	var doc contracts.QuotaDoc
	if code != ExitOK || json.Unmarshal([]byte(out), &doc) != nil || doc.Revision == 0 || doc.Quota.Pools["*"].Guarantee != 0.5 {
		t.Fatalf("quota get -o json: %d %s", code, out)
	}

	file := filepath.Join(t.TempDir(), "quota.yaml")
	if err := os.WriteFile(file, []byte("weight: 3\npools:\n  l4: {guarantee: 2, max: 4}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := h.run("quota", "set", "-f", file, "--tenant", "beta"); code != ExitOK || !strings.Contains(out, "beta") {
		t.Fatalf("quota set -f: %d %q %q", code, out, errOut)
	}
	code, out, _ = h.run("quota", "list")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != ExitOK || len(lines) != 4 || !strings.HasPrefix(lines[1], "acme") || !strings.HasPrefix(lines[3], "beta") {
		t.Fatalf("quota list: want a header, acme's two pools, then beta:\n%s", out)
	}

	for name, tt := range map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"max under guarantee": {[]string{"quota", "set", "--pool", "h100", "--max", "4"}, ExitError, "pools.h100.max: out_of_range"},
		"negative weight":     {[]string{"quota", "set", "--weight", "-1"}, ExitError, "weight: out_of_range"},
		"bad pool":            {[]string{"quota", "set", "--pool", "H.1", "--guarantee", "1"}, ExitError, "invalid_value"},
		"nothing to set":      {[]string{"quota", "set"}, ExitUsage, "nothing to set"},
		"pool alone":          {[]string{"quota", "set", "--pool", "h100"}, ExitUsage, "--pool names where"},
		"max not a number":    {[]string{"quota", "set", "--max", "lots"}, ExitUsage, `--max "lots"`},
		"file and flags":      {[]string{"quota", "set", "-f", file, "--weight", "2"}, ExitUsage, "-f replaces the whole quota"},
		"bad file":            {[]string{"quota", "set", "-f", filepath.Join(t.TempDir(), "none.yaml")}, ExitError, "no such file"},
		"bad tenant":          {[]string{"quota", "get", "--tenant", "Bad.T"}, ExitUsage, "invalid tenant"},
		"unknown subcommand":  {[]string{"quota", "show"}, ExitUsage, `want "quota get"`},
	} {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run(tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("code %d, stderr %q; want %d and %q", code, errOut, tt.code, tt.stderr)
			}
		})
	}
	// The refusals above changed nothing.
	var got contracts.TenantQuota
	if h.kvGet(contracts.BucketQuotas, "acme", &got); got.Pools["h100"].Max != nil || got.Weight != 2 {
		t.Fatalf("a refused edit was stored: %+v", got)
	}

	if code, out, _ := h.run("quota", "delete"); code != ExitOK || !strings.Contains(out, "has no quota") {
		t.Fatalf("quota delete: %d %q", code, out)
	}
	if h.kvGet(contracts.BucketQuotas, "acme", &got) {
		t.Fatal("quota still in KV after delete")
	}
}

func ptr[T any](v T) *T { return &v }

// regexpMatch reports whether s matches the regular expression re.
func regexpMatch(s, re string) bool { return regexp.MustCompile(re).MatchString(s) }

func TestPoolCommands(t *testing.T) {
	h := start(t)
	h.inventory(h100("h100-01"))
	h.eventually("the node", func() bool { _, out, _ := h.run("nodes"); return strings.Contains(out, "h100-01") })
	code, out, errOut := h.run("pool", "get")
	if code != ExitOK || !regexpMatch(out, `h100\s+default\s+1\s+-`) {
		t.Fatalf("pool get: %d %q %q", code, out, errOut)
	}
	if code, out, errOut := h.run("pool", "set", "h100", "--policy", "binpack"); code != ExitOK || !regexpMatch(out, `h100\s+binpack\s+1\s+\d+`) {
		t.Fatalf("pool set: %d %q %q", code, out, errOut)
	}
	var c contracts.PoolConfig
	if !h.kvGet(contracts.BucketPools, "h100", &c) || c.Policy != contracts.PolicyBinpack {
		t.Fatalf("KV: %+v", c)
	}
	code, out, _ = h.run("pool", "get", "h100", "-o", "json")
	var doc contracts.PoolDoc
	if code != ExitOK || json.Unmarshal([]byte(out), &doc) != nil || doc.Config.Policy != contracts.PolicyBinpack || doc.Nodes != 1 {
		t.Fatalf("pool get h100 -o json: %d %s", code, out)
	}
	// The runtime policy: set with its flags, kept by a set without them.
	if code, out, errOut := h.run("pool", "set", "h100", "--policy", "binpack", "--host-commands", "--mount-roots", "/data,/scratch"); code != ExitOK ||
		!strings.Contains(out, "images and host commands; mounts from /data,/scratch") {
		t.Fatalf("pool set runtime: %d %q %q", code, out, errOut)
	}
	if code, out, errOut := h.run("pool", "set", "h100", "--policy", "spread"); code != ExitOK || !strings.Contains(out, "images and host commands") {
		t.Fatalf("pool set keeping the runtime: %d %q %q", code, out, errOut)
	}
	if !h.kvGet(contracts.BucketPools, "h100", &c) || c.Runtime == nil || !c.Runtime.AllowHostCommands || len(c.Runtime.MountRoots) != 2 {
		t.Fatalf("KV: %+v", c)
	}
	if code, out, errOut := h.run("pool", "set", "h100", "--policy", "binpack", "--mount-roots", "none"); code != ExitOK || !strings.Contains(out, "images only") {
		t.Fatalf("pool set images only: %d %q %q", code, out, errOut)
	}
	for name, tt := range map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"mount root /proc": {[]string{"pool", "set", "h100", "--policy", "spread", "--mount-roots", "/proc"}, ExitError, "runtime.mountRoots[0]: mount_not_allowed"},
		"invalid policy":   {[]string{"pool", "set", "h100", "--policy", "random"}, ExitError, `policy: invalid_value: unknown policy "random"`},
		"no policy":        {[]string{"pool", "set", "h100"}, ExitUsage, "--policy is required"},
		"bad pool":         {[]string{"pool", "set", "H100", "--policy", "spread"}, ExitUsage, `invalid pool "H100"`},
		"set no pool":      {[]string{"pool", "set"}, ExitUsage, `want "pool get [POOL]"`},
		"two pools":        {[]string{"pool", "get", "a", "b"}, ExitUsage, `want "pool get [POOL]"`},
	} {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run(tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("code %d, stderr %q; want %d and %q", code, errOut, tt.code, tt.stderr)
			}
		})
	}
	if code, out, _ := h.run("pool", "delete", "h100"); code != ExitOK || !regexpMatch(out, `h100\s+default`) {
		t.Fatalf("pool delete: %d %q", code, out)
	}
}

func TestCordonDrainUncordon(t *testing.T) {
	h := start(t)
	inv := h100("h100-01")
	inv.Purpose, inv.Taints = "training", []contracts.Taint{{Key: "spot", Value: "true", Effect: contracts.TaintNoSchedule}}
	h.inventory(inv)
	h.eventually("the node", func() bool { _, out, _ := h.run("nodes"); return strings.Contains(out, "h100-01") })

	if code, out, errOut := h.run("cordon", "h100-01", "--reason", "fan noise"); code != ExitOK ||
		out != "node h100-01 cordoned: no new work, its jobs go on (fan noise)\n" {
		t.Fatalf("cordon: %d %q %q", code, out, errOut)
	}
	var a contracts.NodeAdmin
	if !h.kvGet(contracts.BucketNodeAdmin, "h100-01", &a) || !a.Cordoned || a.Drain || a.Reason != "fan noise" {
		t.Fatalf("KV after cordon: %+v", a)
	}
	if _, out, _ := h.run("nodes"); !regexpMatch(out, `h100-01.*\s+cordoned\s+8 × H100-80GB.*spot=true:NoSchedule`) {
		t.Errorf("nodes does not show the cordon and taint:\n%s", out)
	}
	_, out, _ := h.run("nodes", "h100-01")
	for _, want := range []string{"Scheduling:", "cordoned since", "(fan noise)", "Purpose:", "training", "Taints:", "spot=true:NoSchedule"} {
		if !strings.Contains(out, want) {
			t.Errorf("nodes h100-01 lacks %q:\n%s", want, out)
		}
	}
	if code, out, _ := h.run("drain", "h100-01"); code != ExitOK || out != "node h100-01 draining: no new work, its jobs are moved off\n" {
		t.Fatalf("drain: %d %q", code, out)
	}
	if !h.kvGet(contracts.BucketNodeAdmin, "h100-01", &a) || !a.Drain {
		t.Fatalf("KV after drain: %+v", a)
	}
	code, out, _ := h.run("uncordon", "h100-01", "-o", "json")
	var st contracts.NodeStatus
	if code != ExitOK || json.Unmarshal([]byte(out), &st) != nil || st.NodeID != "h100-01" || st.Admin != nil {
		t.Fatalf("uncordon -o json: %d %s", code, out)
	}
	if h.kvGet(contracts.BucketNodeAdmin, "h100-01", &a) {
		t.Fatal("hold still in KV after uncordon")
	}
	if _, out, _ := h.run("nodes"); !strings.Contains(out, "schedulable") {
		t.Errorf("nodes after uncordon:\n%s", out)
	}
	for name, tt := range map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"unknown node":    {[]string{"cordon", "ghost"}, ExitError, "unknown_node: no node ghost"},
		"drain unknown":   {[]string{"drain", "ghost", "--reason", "x"}, ExitError, "HTTP 404"},
		"bad node":        {[]string{"uncordon", "a.b"}, ExitUsage, "invalid id"},
		"no node":         {[]string{"cordon"}, ExitUsage, "want exactly one node ID"},
		"reason too long": {[]string{"drain", "h100-01", "--reason", strings.Repeat("x", contracts.MaxAdminReason+1)}, ExitError, "reason: out_of_range"},
	} {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run(tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("code %d, stderr %q; want %d and %q", code, errOut, tt.code, tt.stderr)
			}
		})
	}
}

// publishNth publishes ev with the n-th ID of its type and attempt, as the
// scheduler numbers pending events.
func (h *harness) publishNth(ev contracts.JobEvent, n int) {
	h.t.Helper()
	ev.SchemaVersion = contracts.SchemaVersion
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectJobEvents(ev.Tenant, ev.JobID),
		contracts.JobEventID(ev.Tenant, ev.JobID, ev.Type, ev.Attempt, n), ev); err != nil {
		h.t.Fatal(err)
	}
}

func TestDescribe(t *testing.T) {
	h := start(t)
	if code, _, errOut := h.run("submit", "--id", "gang", "--name", "llm", "--gpus", "16", "--model", "H100-80GB", "--nodes", "2",
		"--topology", "nvlink", "--cpu", "96", "--memory", "512Gi", "--selector", "zone=a", "--toleration", "spot:Exists",
		"--depends-on", "prep", "--expected", "2h", "--placement-timeout", "30m", "--priority", "high"); code != ExitOK {
		t.Fatalf("submit: %s", errOut)
	}
	h.queue(h.submitted("gang"), time.Now().Add(-time.Minute))
	pend := func(n int, reason contracts.Reason, msg string, at time.Time) {
		h.publishNth(contracts.JobEvent{Type: contracts.EventPending, State: contracts.StateQueued, Tenant: "acme", JobID: "gang",
			Attempt: 1, Time: at, Reason: reason, Message: msg}, n)
	}
	pend(1, contracts.PendingDependencies, "waiting for prep (running)", time.Now().Add(-50*time.Second))
	const why = "needs 2 machines of 8×H100-80GB in one NVLink domain; largest free block is 6 on h100-03"
	pend(2, contracts.PendingInsufficientGPUs, why, time.Now().Add(-40*time.Second))

	var out string
	h.eventually("the pending reason", func() bool {
		_, out, _ = h.run("describe", "gang")
		return strings.Contains(out, string(contracts.PendingInsufficientGPUs))
	})
	for _, want := range []string{"Job:", "gang", "Name:", "llm", "State:", "queued (attempt 1)",
		"Pending:", "insufficient_free_gpus for 4", "Why:", why,
		"Requested:", "16 × H100-80GB over 2 machines (8 each), NVLink", "Per machine:", "96 CPU, 512 GiB",
		"Node selector:", "zone=a", "Tolerations:", "spot:Exists", "Depends on:", "prep",
		"Placement timeout:", "30m0s", "Expected run time:", "2h0m0s", "Events:", "waiting_for_dependencies", "waiting for prep (running)"} {
		if !strings.Contains(out, want) {
			t.Errorf("describe lacks %q:\n%s", want, out)
		}
	}
	// The reason a job waits comes before what it asked for.
	if strings.Index(out, "Pending:") > strings.Index(out, "Requested:") {
		t.Errorf("the pending reason is not above the request:\n%s", out)
	}
	if strings.Contains(out, "Placements:") {
		t.Errorf("a pending job shows placements:\n%s", out)
	}

	part := func(node string) contracts.Placement {
		p := contracts.Placement{AllocationID: "alloc-" + node, NodeID: node, Pool: "h100"}
		for i := range 8 {
			p.Devices = append(p.Devices, contracts.DeviceRef{Index: i, Model: "H100-80GB"})
		}
		return p
	}
	h.publishNth(contracts.JobEvent{Type: contracts.EventScheduled, State: contracts.StateScheduled, Tenant: "acme", JobID: "gang",
		Attempt: 1, Time: time.Now(), Placements: []contracts.Placement{part("h100-01"), part("h100-02")}}, 0)
	h.eventually("scheduled", func() bool { _, out, _ = h.run("describe", "gang"); return strings.Contains(out, "Placements:") })
	if strings.Contains(out, "Pending:") || !regexpMatch(out, `0\s+h100-01\s+h100\s+8 × H100-80GB \[0,1,2,3,4,5,6,7\]\s+alloc-h100-01`) ||
		!regexpMatch(out, `1\s+h100-02`) {
		t.Errorf("describe of the scheduled gang:\n%s", out)
	}
	code, out, _ := h.run("describe", "gang", "-o", "json")
	var d contracts.JobDescription
	if code != ExitOK || json.Unmarshal([]byte(out), &d) != nil || len(d.Placements) != 2 || len(d.Events) != 4 || d.DependsOn[0] != "prep" {
		t.Fatalf("describe -o json: %d %s", code, out)
	}
	if code, _, errOut := h.run("describe", "nope"); code != ExitError || !strings.Contains(errOut, "unknown_job") {
		t.Fatalf("describe nope: %d %q", code, errOut)
	}
	if code, _, errOut := h.run("describe"); code != ExitUsage || !strings.Contains(errOut, "want exactly one job ID") {
		t.Fatalf("describe without ID: %d %q", code, errOut)
	}
}
