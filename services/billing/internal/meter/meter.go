// Package meter is billing's pure core: it turns a ledger entry into the
// usage record that bills it, or into nothing when there is nothing to bill.
// The record depends only on the entry, so metering the same entry twice
// yields the same record, ID and body alike.
package meter

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// ErrMalformed is returned (wrapped) for a released entry that claims a run
// but cannot be billed as it stands; retrying cannot fix it.
var ErrMalformed = errors.New("malformed ledger entry")

// Meter returns the usage record of a released allocation whose run started:
// GPUs = number of devices, GPUMillis = GPUs × (EndedAt − StartedAt) in
// milliseconds. ok is false for entries that bill nothing: commits, and
// releases of runs that never started.
func Meter(e contracts.LedgerEntry) (rec contracts.UsageRecord, ok bool, err error) {
	if e.Kind != contracts.LedgerReleased || e.Run == nil || e.Run.StartedAt.IsZero() {
		return contracts.UsageRecord{}, false, nil
	}
	a := e.Allocation
	var problems []string
	if a.ID == "" {
		problems = append(problems, "no allocation ID")
	}
	if err := contracts.ValidateTenant(a.Tenant); err != nil {
		problems = append(problems, err.Error())
	}
	if len(a.Devices) == 0 {
		problems = append(problems, "no devices")
	}
	if e.Run.EndedAt.Before(e.Run.StartedAt) {
		problems = append(problems, fmt.Sprintf("run ended at %s, before it started at %s", e.Run.EndedAt, e.Run.StartedAt))
	}
	if len(problems) > 0 {
		return contracts.UsageRecord{}, false, fmt.Errorf("%w: allocation %q: %s", ErrMalformed, a.ID, strings.Join(problems, "; "))
	}
	gpus := len(a.Devices)
	millis := int64(gpus) * e.Run.EndedAt.Sub(e.Run.StartedAt).Milliseconds()
	return contracts.UsageRecord{
		SchemaVersion: contracts.SchemaVersion,
		ID:            contracts.UsageID(a.ID),
		AllocationID:  a.ID,
		Tenant:        a.Tenant,
		JobID:         a.JobID,
		Attempt:       a.Attempt,
		NodeID:        a.NodeID,
		Pool:          a.Pool,
		GPUModel:      model(a.Devices),
		GPUs:          gpus,
		Start:         e.Run.StartedAt,
		End:           e.Run.EndedAt,
		GPUMillis:     millis,
		GPUSeconds:    float64(millis) / 1000,
		Time:          e.Time,
	}, true, nil
}

// model names the devices' GPU model; several models, which one allocation
// should never hold, are listed in order joined by "+".
func model(devs []contracts.DeviceRef) string {
	var models []string
	for _, d := range devs {
		if !slices.Contains(models, d.Model) {
			models = append(models, d.Model)
		}
	}
	slices.Sort(models)
	return strings.Join(models, "+")
}
