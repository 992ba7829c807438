package contracts

import (
	"encoding/json"
	"fmt"

	"github.com/invopop/jsonschema"
)

// schemaTypes maps each published JSON Schema file name to its message type.
// Non-Go clients validate against these files; TestSchemasUpToDate fails
// when a type changes and the files were not regenerated (make schemas).
var schemaTypes = map[string]any{
	"job-request.json":    JobRequest{},
	"cancel-request.json": CancelRequest{},
	"job-event.json":      JobEvent{},
	"plan.json":           Plan{},
	"ledger-entry.json":   LedgerEntry{},
	"refusal.json":        Refusal{},
	"run-event.json":      RunEvent{},
	"node-command.json":   NodeCommand{},
	"node-inventory.json": NodeInventory{},
	"heartbeat.json":      Heartbeat{},
	"telemetry.json":      Telemetry{},
	"node-event.json":     NodeEvent{},
	"health-event.json":   HealthEvent{},
	"pool-demand.json":    PoolDemand{},
	"scale-decision.json": ScaleDecision{},
	"alert.json":          Alert{},
	"machine-event.json":  MachineEvent{},
	"usage-record.json":   UsageRecord{},
	"price-book.json":     PriceBook{},
	"budget.json":         Budget{},
	"budget-status.json":  BudgetStatus{},
	"lease.json":          Lease{},
	"log-chunk.json":      LogChunk{},
	"tenant-quota.json":   TenantQuota{},
	"pool-config.json":    PoolConfig{},
	"node-admin.json":     NodeAdmin{},
	// Request bodies of the gateway's node endpoints.
	"node-admin-request.json": NodeAdminRequest{},
	"fault-request.json":      FaultRequest{},
	"audit-record.json":       AuditRecord{},
}

// Schemas returns the JSON Schema document of every message, by file name.
func Schemas() (map[string][]byte, error) {
	out := make(map[string][]byte, len(schemaTypes))
	for name, v := range schemaTypes {
		r := &jsonschema.Reflector{
			// Fields are required only when the Go type says so through
			// validation; omitempty fields are optional.
			RequiredFromJSONSchemaTags: false,
			AllowAdditionalProperties:  false,
		}
		s := r.Reflect(v)
		s.ID = jsonschema.ID("https://gpuplane.dev/schemas/v1/" + name)
		b, err := json.MarshalIndent(s, "", "  ")
		if err != nil {
			return nil, fmt.Errorf("schema %s: %w", name, err)
		}
		out[name] = append(b, '\n')
	}
	return out, nil
}
