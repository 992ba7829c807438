package contracts

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"

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
		s := Reflect(v)
		s.ID = jsonschema.ID("https://gpuplane.dev/schemas/v1/" + name)
		b, err := json.MarshalIndent(s, "", "  ")
		if err != nil {
			return nil, fmt.Errorf("schema %s: %w", name, err)
		}
		out[name] = append(b, '\n')
	}
	return out, nil
}

// Reflect returns the JSON Schema of a type of this package as the
// published files state it; the gateway's OpenAPI document reflects its
// API types with it too (contracts/openapi), so the two agree.
func Reflect(v any) *jsonschema.Schema {
	r := &jsonschema.Reflector{
		// Fields are required only when the Go type says so through
		// validation; omitempty and omitzero fields are optional.
		RequiredFromJSONSchemaTags: false,
		AllowAdditionalProperties:  false,
	}
	s := r.Reflect(v)
	optionalZeros(s, reflect.TypeOf(v), map[reflect.Type]bool{})
	return s
}

// optionalZeros drops the fields tagged omitzero from the required list
// of their type's definition: encoding/json leaves them out when zero (an
// API token that never expires has no expiresAt), which
// invopop/jsonschema v0.13 does not know.
func optionalZeros(s *jsonschema.Schema, t reflect.Type, seen map[reflect.Type]bool) {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice || t.Kind() == reflect.Array || t.Kind() == reflect.Map {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || seen[t] {
		return
	}
	seen[t] = true
	var zero []string
	var fields func(t reflect.Type)
	fields = func(t reflect.Type) {
		for i := range t.NumField() {
			f := t.Field(i)
			name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "-" || (!f.IsExported() && !f.Anonymous) {
				continue
			}
			if f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct {
				fields(f.Type) // inlined into t's definition
				continue
			}
			if name == "" {
				name = f.Name
			}
			if slices.Contains(strings.Split(opts, ","), "omitzero") {
				zero = append(zero, name)
			}
			optionalZeros(s, f.Type, seen)
		}
	}
	fields(t)
	if def := s.Definitions[t.Name()]; def != nil && len(zero) > 0 {
		def.Required = slices.DeleteFunc(def.Required, func(r string) bool { return slices.Contains(zero, r) })
	}
}
