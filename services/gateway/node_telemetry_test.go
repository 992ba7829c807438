package gateway

import (
	"context"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestNodeTelemetryReadsTheMachinesRecentBatches: the machine's own
// batches from the stream, oldest first, thinned to the points asked for
// with the latest kept; another machine's are not among them; bad
// parameters and unknown nodes are refused.
func TestNodeTelemetryReadsTheMachinesRecentBatches(t *testing.T) {
	h := startGateway(t, nil, func(h *harness) {
		h.publishInventory(inventory("sim-1", "sim"), 1)
		h.publishInventory(inventory("sim-2", "sim"), 1)
	})
	h.waitNode("sim-2")
	ctx := context.Background()
	base := time.Now().UTC()
	const n = 300
	for i := range n {
		for _, node := range []string{"sim-1", "sim-2"} {
			tel := contracts.Telemetry{SchemaVersion: contracts.SchemaVersion, NodeID: node, Hostname: node, Pool: "h100",
				Time: base.Add(time.Duration(i) * time.Second), GPUs: []contracts.GPUSample{{Index: 0, UUID: "GPU-" + node + "-0",
					Model: "H100-80GB", GPUUtil: float64(i % 100), Healthy: true}}}
			if err := h.bus.PublishCore(ctx, contracts.SubjectTelemetry(node), tel); err != nil {
				t.Fatal(err)
			}
		}
	}
	var got contracts.NodeTelemetry
	h.eventually("every batch in the stream", func() bool {
		got = contracts.NodeTelemetry{}
		s, _ := h.do(http.MethodGet, "/v1/nodes/sim-1/telemetry?points=50", "", &got)
		return s == http.StatusOK && got.Read == n
	})
	if len(got.Samples) != 50 || got.NodeID != "sim-1" || !got.Samples[49].Time.Equal(base.Add((n-1)*time.Second)) {
		t.Fatalf("%d samples of %s, last at %v; want 50 ending with the latest", len(got.Samples), got.NodeID, got.Samples[len(got.Samples)-1].Time)
	}
	for i, s := range got.Samples {
		if s.NodeID != "sim-1" || (i > 0 && !s.Time.After(got.Samples[i-1].Time)) {
			t.Fatalf("sample %d: %s at %v, want sim-1's in time order", i, s.NodeID, s.Time)
		}
	}
	for path, status := range map[string]int{
		"/v1/nodes/sim-1/telemetry?since=2h":   http.StatusBadRequest,
		"/v1/nodes/sim-1/telemetry?points=0":   http.StatusBadRequest,
		"/v1/nodes/nosuch/telemetry":           http.StatusNotFound,
		"/v1/nodes/sim-1/telemetry?since=1m":   http.StatusOK,
		"/v1/nodes/sim-1/telemetry?points=600": http.StatusOK,
	} {
		if s, body := h.do(http.MethodGet, path, "", nil); s != status {
			t.Errorf("GET %s: %d %s, want %d", path, s, body, status)
		}
	}
}

func TestThinKeepsTheLatest(t *testing.T) {
	mk := func(n int) []contracts.Telemetry {
		out := make([]contracts.Telemetry, n)
		for i := range out {
			out[i].GPUs = []contracts.GPUSample{{Index: i}}
		}
		return out
	}
	idx := func(ts []contracts.Telemetry) []int {
		var out []int
		for _, t := range ts {
			out = append(out, t.GPUs[0].Index)
		}
		return out
	}
	tests := map[string]struct {
		have, keep int
		want       []int
	}{
		"fewer than asked": {3, 5, []int{0, 1, 2}},
		"one":              {10, 1, []int{9}},
		"two":              {10, 2, []int{0, 9}},
		"evenly":           {9, 5, []int{0, 2, 4, 6, 8}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if got := idx(thin(mk(tt.have), tt.keep)); !slices.Equal(got, tt.want) {
				t.Fatalf("thin(%d, %d) = %v, want %v", tt.have, tt.keep, got, tt.want)
			}
		})
	}
}
