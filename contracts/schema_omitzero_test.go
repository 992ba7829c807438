package contracts

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v6"
)

// TestOmitzeroFieldsAreOptional marshals documents whose omitzero times
// are zero, as the platform writes them (a hold the scheduler set without
// a since, a run fact of a run that never started), and checks each
// against its published schema: encoding/json leaves those fields out, so
// the schema must not require them.
func TestOmitzeroFieldsAreOptional(t *testing.T) {
	ended := time.Date(2026, 11, 3, 10, 0, 0, 0, time.UTC)
	tests := map[string]struct {
		file string
		doc  any
	}{
		"node hold without times": {"node-admin.json", NodeAdmin{SchemaVersion: SchemaVersion, NodeID: "n1", Cordoned: true,
			GPUs: map[string]GPUHold{"GPU-1": {Cordoned: true, Reason: "xid"}}}},
		"run that never started": {"run-event.json", RunEvent{SchemaVersion: SchemaVersion, Kind: RunEnded, AllocationID: "a1",
			NodeID: "n1", Tenant: "acme", JobID: "j1", Attempt: 1, Devices: []DeviceRef{}, Time: ended,
			Result: &RunResult{Outcome: OutcomeFailed, ExitCode: 1, EndedAt: ended}}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			sch := oracle(t, tt.file)
			b, err := json.Marshal(tt.doc)
			if err != nil {
				t.Fatal(err)
			}
			inst, err := jsonschema.UnmarshalJSON(bytes.NewReader(b))
			if err != nil {
				t.Fatal(err)
			}
			if err := sch.Validate(inst); err != nil {
				t.Fatalf("%s refuses %s: %v", tt.file, b, err)
			}
		})
	}
}
