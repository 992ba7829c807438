package gpuctl

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// kvPut writes a node hold as the platform does (the scheduler, the
// autoscaler), straight to KV.
func (h *harness) kvPut(bucket, key string, v any) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	kv, err := h.bus.KeyValue(ctx, bucket)
	if err != nil {
		h.t.Fatal(err)
	}
	b, _ := json.Marshal(v)
	if _, err := kv.Put(ctx, key, b); err != nil {
		h.t.Fatal(err)
	}
}

// TestGPUHoldCommands: cordon, drain and uncordon --gpu hold and release
// one GPU through a real gateway; nodes shows the platform's holds with
// their cause and deadline, and each held GPU.
func TestGPUHoldCommands(t *testing.T) {
	h := start(t)
	h.inventory(h100("h100-01"))
	h.eventually("the node", func() bool { _, out, _ := h.run("nodes"); return strings.Contains(out, "h100-01") })

	// The autoscaler drains the node on a spot notice; the scheduler
	// holds a sick GPU.
	deadline := time.Now().Add(2 * time.Minute).UTC().Truncate(time.Second)
	h.kvPut(contracts.BucketNodeAdmin, "h100-01", contracts.NodeAdmin{SchemaVersion: 1, NodeID: "h100-01", Cordoned: true, Drain: true,
		Cause: contracts.ReasonSpotInterruption, Reason: "reclaim notice", Deadline: &deadline, Time: time.Now().UTC(),
		GPUs: map[string]contracts.GPUHold{"GPU-h100-01-3": {Cordoned: true, Cause: contracts.ReasonGPUUnhealthy, Reason: "XID 79", Since: time.Now().UTC()}}})
	var out string
	h.eventually("the platform's holds listed", func() bool {
		_, out, _ = h.run("nodes")
		return strings.Contains(out, "draining (spot_interruption), 1 GPU held")
	})
	_, out, _ = h.run("nodes", "h100-01")
	for _, want := range []string{"Scheduling:", "draining (spot_interruption), 1 GPU held since", "(reclaim notice)", "Deadline:",
		deadline.Local().Format(timeLayout), "HELD GPU", "GPU-h100-01-3", "gpu_unhealthy", "XID 79"} {
		if !strings.Contains(out, want) {
			t.Errorf("nodes h100-01 lacks %q:\n%s", want, out)
		}
	}
	if !regexpMatch(out, `(?m)^3\s+GPU-h100-01-3\s+cordoned\s+gpu_unhealthy\s+XID 79\s`) {
		t.Errorf("the held GPU's row is wrong:\n%s", out)
	}

	for _, tc := range []struct {
		args []string
		out  string
	}{
		{[]string{"cordon", "h100-01", "--gpu", "GPU-h100-01-5", "--reason", "fan noise"},
			"GPU GPU-h100-01-5 of node h100-01 cordoned: no new work, its runs go on (fan noise)\n"},
		{[]string{"drain", "h100-01", "--gpu", "GPU-h100-01-6"},
			"GPU GPU-h100-01-6 of node h100-01 draining: no new work, its runs are moved off\n"},
		{[]string{"uncordon", "h100-01", "--gpu", "GPU-h100-01-3"},
			"GPU GPU-h100-01-3 of node h100-01 uncordoned; the node itself is still draining (spot_interruption), 2 GPUs held\n"},
	} {
		if code, got, errOut := h.run(tc.args...); code != ExitOK || got != tc.out {
			t.Fatalf("%v: %d %q %q; want %q", tc.args, code, got, errOut, tc.out)
		}
	}
	var a contracts.NodeAdmin
	if !h.kvGet(contracts.BucketNodeAdmin, "h100-01", &a) || len(a.GPUs) != 2 || !a.GPUs["GPU-h100-01-6"].Drain ||
		a.GPUs["GPU-h100-01-5"].Reason != "fan noise" || a.Cause != contracts.ReasonSpotInterruption {
		t.Fatalf("KV after the GPU edits: %+v", a)
	}
	// Lifting the node's hold lifts everything.
	if code, out, _ := h.run("uncordon", "h100-01"); code != ExitOK || !strings.Contains(out, "takes new work") {
		t.Fatalf("uncordon: %d %q", code, out)
	}
	code, out, _ := h.run("cordon", "h100-01", "--gpu", "GPU-h100-01-1", "-o", "json")
	var st contracts.NodeStatus
	if code != ExitOK || json.Unmarshal([]byte(out), &st) != nil || st.Admin == nil || st.Admin.Cordoned || !st.Admin.GPUs["GPU-h100-01-1"].Cordoned {
		t.Fatalf("cordon --gpu -o json: %d %s", code, out)
	}
	if _, out, _ := h.run("nodes"); !strings.Contains(out, "schedulable, 1 GPU held") {
		t.Errorf("nodes with one GPU held:\n%s", out)
	}
	if code, out, _ := h.run("uncordon", "h100-01", "--gpu", "GPU-h100-01-1"); code != ExitOK ||
		out != "GPU GPU-h100-01-1 of node h100-01 uncordoned: it takes new work\n" || h.kvGet(contracts.BucketNodeAdmin, "h100-01", &a) {
		t.Fatalf("uncordon of the last GPU: %d %q (KV %+v)", code, out, a)
	}

	for name, tt := range map[string]struct {
		args   []string
		code   int
		stderr string
	}{
		"bad uuid":     {[]string{"cordon", "h100-01", "--gpu", "GPU/1"}, ExitUsage, "invalid GPU UUID"},
		"empty uuid":   {[]string{"uncordon", "h100-01", "--gpu", ""}, ExitUsage, "invalid GPU UUID"},
		"unknown GPU":  {[]string{"cordon", "h100-01", "--gpu", "GPU-h100-01-9"}, ExitError, "unknown_device: node h100-01 has no GPU GPU-h100-01-9"},
		"MIG instance": {[]string{"drain", "h100-01", "--gpu", "MIG-a"}, ExitError, "a hold is on a whole GPU"},
		"unknown node": {[]string{"cordon", "ghost", "--gpu", "GPU-ghost-0"}, ExitError, "unknown_node"},
	} {
		t.Run(name, func(t *testing.T) {
			code, _, errOut := h.run(tt.args...)
			if code != tt.code || !strings.Contains(errOut, tt.stderr) {
				t.Fatalf("code %d, stderr %q; want %d and %q", code, errOut, tt.code, tt.stderr)
			}
		})
	}
}
