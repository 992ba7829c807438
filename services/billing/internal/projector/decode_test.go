package projector

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestDecodeReadsWhatTheStoreNeeds(t *testing.T) {
	start := time.Date(2026, 11, 3, 4, 5, 6, 0, time.UTC)
	full := contracts.UsageRecord{SchemaVersion: 1, ID: "usage/acme/j\\1/1/s0", AllocationID: "acme/j1/1", Tenant: "acme", JobID: "j1",
		Pool: "h100", Start: start, End: start.Add(time.Hour), GPUMillis: 7, GPUs: 2,
		UsageSegment: contracts.UsageSegment{CostMicros: 11, OnDemandCostMicros: 13, Devices: []contracts.DeviceRef{{UUID: "x"}}}}
	data, _ := json.Marshal(full)
	got, err := decode(data)
	if err != nil {
		t.Fatal(err)
	}
	want := contracts.UsageRecord{ID: full.ID, AllocationID: "acme/j1/1", Tenant: "acme", JobID: "j1", Pool: "h100", Start: start, GPUMillis: 7,
		UsageSegment: contracts.UsageSegment{CostMicros: 11, OnDemandCostMicros: 13}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	// Zero costs are omitted from the JSON: still read.
	free := full
	free.CostMicros, free.OnDemandCostMicros = 0, 0
	data, _ = json.Marshal(free)
	if got, err := decode(data); err != nil || got.CostMicros != 0 || got.ID != full.ID {
		t.Errorf("a free record: %+v, %v", got, err)
	}
	for name, bad := range map[string]string{
		"not JSON":       `{"id":`,
		"wrong type":     `{"id":"x","tenant":"a","jobId":"j","pool":"p","start":"2026-11-03T00:00:00Z","gpuMillis":"many"}`,
		"bad time":       `{"id":"x","tenant":"a","jobId":"j","pool":"p","start":"yesterday","gpuMillis":1}`,
		"unknown, empty": `{}`,
	} {
		r, err := decode([]byte(bad))
		if name == "unknown, empty" {
			if err != nil || r.ID != "" {
				t.Errorf("%s: %+v %v (the caller refuses a record without an ID)", name, r, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("%s: decoded %+v", name, r)
		}
	}
}
