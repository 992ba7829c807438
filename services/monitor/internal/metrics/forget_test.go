package metrics

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/monitor/internal/readmodel"
)

// series lists every exported series as name{label=value,...,}.
func series(t *testing.T, c *Collector) []string {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var b strings.Builder
			b.WriteString(mf.GetName() + "{")
			for _, l := range m.GetLabel() {
				b.WriteString(l.GetName() + "=" + l.GetValue() + ",")
			}
			out = append(out, b.String()+"}")
		}
	}
	return out
}

// TestDepartedNodeStopsExporting: once a machine is deleted, /metrics shows
// none of its GPUs nor its heartbeat, and once the model forgot it, it no
// longer counts among the pool's nodes; the node that stays exports on.
func TestDepartedNodeStopsExporting(t *testing.T) {
	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	const stale = 3 * time.Second
	m := readmodel.New()
	for _, n := range []string{"n1", "n2"} {
		m.ApplyInventory(n, contracts.NodeInventory{Pool: "spot", GPUs: []contracts.GPUInfo{{UUID: "GPU-" + n, Healthy: true}}}, t0)
		m.ApplyTelemetry(n, contracts.Telemetry{Hostname: "host-" + n, Pool: "spot",
			GPUs: []contracts.GPUSample{{UUID: "GPU-" + n, GPUUtil: 50}}}, t0)
		m.ApplyHeartbeat(n, t0)
	}
	now := t0.Add(time.Second)
	c := New(m, nil, stale, func() time.Time { return now })
	has := func(name, label, value string) bool {
		return slices.ContainsFunc(series(t, c), func(s string) bool {
			return strings.HasPrefix(s, name+"{") && containsLabel(s, label, value)
		})
	}
	if !has("DCGM_FI_DEV_GPU_UTIL", "UUID", "GPU-n1") || !has("gpuplane_node_heartbeat_age_seconds", "node", "n1") {
		t.Fatalf("n1 not exported before it left:\n%v", series(t, c))
	}

	m.ApplyNodeLeft("n1", t0.Add(time.Second))
	now = t0.Add(2 * time.Second)
	if has("DCGM_FI_DEV_GPU_UTIL", "UUID", "GPU-n1") || has("gpuplane_node_heartbeat_age_seconds", "node", "n1") {
		t.Errorf("n1 still exported after its machine was deleted:\n%v", series(t, c))
	}
	if !has("DCGM_FI_DEV_GPU_UTIL", "UUID", "GPU-n2") || !has("gpuplane_node_heartbeat_age_seconds", "node", "n2") {
		t.Errorf("n2, still there, is not exported:\n%v", series(t, c))
	}

	// n2 keeps talking; n1 is forgotten a silent period after it left.
	now = t0.Add(10 * time.Second)
	m.ApplyTelemetry("n2", contracts.Telemetry{Hostname: "host-n2", Pool: "spot",
		GPUs: []contracts.GPUSample{{UUID: "GPU-n2", GPUUtil: 50}}}, now)
	m.ApplyHeartbeat("n2", now)
	if n := m.Forget(now.Add(-stale)); n != 1 {
		t.Fatalf("Forget dropped %d nodes; want n1", n)
	}
	snap := m.Snapshot(now.Add(-stale))
	if len(snap.Pools) != 1 || snap.Pools[0].Nodes != 1 || snap.Pools[0].GPUs != 1 {
		t.Errorf("pools = %+v; want spot with n2 alone", snap.Pools)
	}
	for _, s := range series(t, c) {
		if containsLabel(s, "node", "n1") || containsLabel(s, "UUID", "GPU-n1") || containsLabel(s, "Hostname", "host-n1") {
			t.Errorf("series of the forgotten n1 exported: %s", s)
		}
	}
}

func containsLabel(s, label, value string) bool {
	want := label + "=" + value + ","
	return strings.Contains(s, "{"+want) || strings.Contains(s, ","+want)
}
