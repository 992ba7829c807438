package contracts

import (
	"encoding/json"
	"slices"
	"strconv"

	"github.com/invopop/jsonschema"
)

// The published schemas state the bounds that each request type's
// Validate applies, from the same constants, so a client that validates
// against the schema is refused for nothing the schema does not say
// (beyond the few rules a schema cannot state: decode_test.go lists them).
// invopop/jsonschema calls these JSONSchemaExtend methods while it
// reflects each type.

func prop(s *jsonschema.Schema, name string) *jsonschema.Schema {
	p, ok := s.Properties.Get(name)
	if !ok {
		panic("contracts: schema has no property " + name) // a renamed field; TestSchemasUpToDate runs this
	}
	return p
}

func bound(p *jsonschema.Schema, lo, hi int64) {
	p.Minimum = json.Number(strconv.FormatInt(lo, 10))
	p.Maximum = json.Number(strconv.FormatInt(hi, 10))
}

func count(n int) *uint64 { u := uint64(n); return &u }

func enumOf[T ~string](vals ...T) []any {
	out := make([]any, len(vals))
	for i, v := range vals {
		out[i] = string(v)
	}
	return out
}

// optionalPattern is re with the empty string allowed too: a field that
// Validate reads as absent when empty.
func optionalPattern(re string) string { return "^(" + re[1:len(re)-1] + ")?$" }

// JSONSchemaExtend states JobRequest's bounds.
func (JobRequest) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "tenant").Pattern = tenantPattern
	prop(s, "name").MaxLength = count(MaxNameLength)
	prop(s, "pool").Pattern = optionalPattern(poolPattern)
	prop(s, "labels").MaxProperties = count(MaxLabels)
	prop(s, "nodeSelector").MaxProperties = count(MaxSelectorLabels)
	prop(s, "tolerations").MaxItems = count(MaxTolerations)
	deps := prop(s, "dependsOn")
	deps.MaxItems = count(MaxDependsOn)
	deps.Items.Pattern = idPattern
}

// JSONSchemaExtend states GPURequest's bounds and model names.
func (GPURequest) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "model").Enum = enumOf(append([]string{GPUModelAny}, GPUModels...)...)
	models := prop(s, "models")
	models.MaxItems = count(MaxAllowedModels)
	models.Items.Enum = enumOf(GPUModels...)
	bound(prop(s, "memoryMiB"), 0, MaxGPUMemoryMiB)
}

// JSONSchemaExtend states GPUShare's bounds.
func (GPUShare) JSONSchemaExtend(s *jsonschema.Schema) {
	bound(prop(s, "memoryMiB"), 1, MaxGPUMemoryMiB)
	bound(prop(s, "computePercent"), 1, 99)
}

// JSONSchemaExtend states Resources' bounds.
func (Resources) JSONSchemaExtend(s *jsonschema.Schema) {
	bound(prop(s, "cpuMilli"), 0, MaxCPUMilli)
	bound(prop(s, "memoryMiB"), 0, MaxHostMemoryMiB)
}

// JSONSchemaExtend states RunSpec's bounds.
func (RunSpec) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "command").MaxItems = count(MaxCommandArgs)
	prop(s, "env").MaxProperties = count(MaxEnvVars)
	bound(prop(s, "exitCode"), 0, 255)
	img := prop(s, "image")
	img.MaxLength = count(MaxImageRefBytes)
	img.Pattern = `^\S+$`
	args := prop(s, "args")
	args.MaxItems = count(MaxCommandArgs)
	wd := prop(s, "workingDir")
	wd.Pattern = "^(/|" + cleanPathPattern[1:len(cleanPathPattern)-1] + ")?$"
	wd.MaxLength = count(MaxPathBytes)
	prop(s, "mounts").MaxItems = count(MaxMounts)
	bound(prop(s, "shmSizeMiB"), 0, MaxShmSizeMiB)
	prop(s, "user").Pattern = optionalPattern(userPattern)
}

// JSONSchemaExtend states Mount's paths.
func (Mount) JSONSchemaExtend(s *jsonschema.Schema) {
	for _, name := range []string{"source", "target"} {
		p := prop(s, name)
		p.Pattern = cleanPathPattern
		p.MaxLength = count(MaxPathBytes)
	}
}

// JSONSchemaExtend states PoolRuntime's bounds.
func (PoolRuntime) JSONSchemaExtend(s *jsonschema.Schema) {
	roots := prop(s, "mountRoots")
	roots.MaxItems = count(MaxMountRoots)
	roots.Items.Pattern = cleanPathPattern
	roots.Items.MaxLength = count(MaxPathBytes)
}

// JSONSchemaExtend states the taint effects a toleration may name.
func (Toleration) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "effect").Enum = enumOf("", TaintNoSchedule, TaintPreferNoSchedule)
}

// JSONSchemaExtend states CancelRequest's bounds.
func (CancelRequest) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "schemaVersion").Enum = []any{SchemaVersion}
	prop(s, "jobId").Pattern = idPattern
	prop(s, "reason").MaxLength = count(MaxCancelReasonSz)
}

// JSONSchemaExtend states Budget's bounds.
func (Budget) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "schemaVersion").Enum = []any{SchemaVersion}
	prop(s, "tenant").Pattern = tenantPattern
}

// JSONSchemaExtend states NodeAdminRequest's bounds.
func (NodeAdminRequest) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "reason").MaxLength = count(MaxAdminReason)
}

// JSONSchemaExtend states FaultRequest's kinds and bounds.
func (FaultRequest) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "kind").Enum = enumOf(FaultKinds...)
	bound(prop(s, "code"), 0, maxFaultXID)
}

// JSONSchemaExtend states PriceBook's bounds.
func (PriceBook) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "schemaVersion").Enum = []any{SchemaVersion}
	prop(s, "versions").MaxItems = count(MaxPriceVersions)
}

// JSONSchemaExtend states the GPU models a price version may price.
func (PriceVersion) JSONSchemaExtend(s *jsonschema.Schema) {
	gpu := prop(s, "gpu")
	gpu.MinProperties = count(1)
	gpu.PropertyNames = &jsonschema.Schema{Enum: enumOf(append([]string{AnyGPUModel}, GPUModels...)...)}
}

// JSONSchemaExtend states TenantQuota's bounds. Tenant and updatedAt are
// optional in what a client writes: the gateway fills them in.
func (TenantQuota) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "schemaVersion").Enum = []any{SchemaVersion}
	prop(s, "tenant").Pattern = optionalPattern(tenantPattern)
	w := prop(s, "weight")
	w.Minimum, w.Maximum = "0", "1000"
	prop(s, "pools").PropertyNames = &jsonschema.Schema{Pattern: "^(" + poolPattern[1:len(poolPattern)-1] + `|\*)$`}
	s.Required = notRequired(s.Required, "tenant", "updatedAt")
}

// JSONSchemaExtend states PoolQuota's bounds.
func (PoolQuota) JSONSchemaExtend(s *jsonschema.Schema) {
	for _, name := range []string{"guarantee", "max"} {
		p := prop(s, name)
		p.Minimum, p.Maximum = "0", "1000000"
	}
}

// JSONSchemaExtend states PoolConfig's policies. Pool and updatedAt are
// optional in what a client writes: the gateway fills them in.
func (PoolConfig) JSONSchemaExtend(s *jsonschema.Schema) {
	prop(s, "schemaVersion").Enum = []any{SchemaVersion}
	prop(s, "pool").Pattern = optionalPattern(poolPattern)
	prop(s, "policy").Enum = enumOf(PlacementPolicies...)
	s.Required = notRequired(s.Required, "pool", "updatedAt")
}

func notRequired(req []string, names ...string) []string {
	return slices.DeleteFunc(req, func(r string) bool { return slices.Contains(names, r) })
}
