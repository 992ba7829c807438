package meter

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
)

var start = time.Date(2025, 5, 1, 9, 0, 0, 0, time.UTC)

func released(gpus int, ran time.Duration) contracts.LedgerEntry {
	a := contracts.Allocation{ID: "acme/j1/2", Tenant: "acme", JobID: "j1", Attempt: 2, NodeID: "n1", Pool: "h100"}
	for i := range gpus {
		a.Devices = append(a.Devices, contracts.DeviceRef{Index: i, UUID: "GPU-" + string(rune('a'+i)), Model: "H100-80GB"})
	}
	return contracts.LedgerEntry{Kind: contracts.LedgerReleased, Allocation: a, Time: start.Add(ran + time.Second),
		Reason: contracts.ReasonRunEnded, Run: &contracts.RunResult{Outcome: contracts.OutcomeSucceeded,
			StartedAt: start, EndedAt: start.Add(ran)}}
}

func TestMeterBillsGPUsTimesRunTime(t *testing.T) {
	got, ok, err := Meter(released(4, 90*time.Second+1234567*time.Nanosecond))
	if err != nil || !ok {
		t.Fatalf("Meter: ok=%v err=%v", ok, err)
	}
	want := contracts.UsageRecord{SchemaVersion: 1, ID: "usage/acme/j1/2", AllocationID: "acme/j1/2", Tenant: "acme",
		JobID: "j1", Attempt: 2, NodeID: "n1", Pool: "h100", GPUModel: "H100-80GB", GPUs: 4,
		Start: start, End: start.Add(90*time.Second + 1234567*time.Nanosecond),
		GPUMillis: 4 * 90001, GPUSeconds: 360.004, Time: start.Add(91*time.Second + 1234567*time.Nanosecond)}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("record (-want +got):\n%s", diff)
	}
	again, _, _ := Meter(released(4, 90*time.Second+1234567*time.Nanosecond))
	if !cmp.Equal(got, again) {
		t.Error("metering the same entry twice gave two different records")
	}
}

func TestMeterBillsNothing(t *testing.T) {
	neverRan := released(2, time.Minute)
	neverRan.Run.StartedAt = time.Time{}
	noRun := released(2, time.Minute)
	noRun.Run = nil
	committed := released(2, time.Minute)
	committed.Kind, committed.Run = contracts.LedgerCommitted, nil
	for name, e := range map[string]contracts.LedgerEntry{
		"committed":          committed,
		"released, no run":   noRun,
		"released, no start": neverRan,
	} {
		if rec, ok, err := Meter(e); ok || err != nil {
			t.Errorf("%s: Meter = %+v, %v, %v; want nothing", name, rec, ok, err)
		}
	}
}

func TestMeterRefusesMalformedEntries(t *testing.T) {
	backwards := released(1, time.Minute)
	backwards.Run.EndedAt = start.Add(-time.Second)
	noDevices := released(0, time.Minute)
	badTenant := released(1, time.Minute)
	badTenant.Allocation.Tenant = "ACME.*"
	for name, e := range map[string]contracts.LedgerEntry{
		"ended before it started": backwards,
		"no devices":              noDevices,
		"tenant not a token":      badTenant,
	} {
		if _, ok, err := Meter(e); ok || !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: ok=%v err=%v, want ErrMalformed", name, ok, err)
		}
	}
}
