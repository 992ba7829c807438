package main

import (
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
)

// apiTypes are the gateway's request and response bodies that are not
// published as a file of contracts/schema (those are bus messages and
// stored documents). They are reflected as contracts.Schemas reflects
// its types (contracts.Reflect); every type they share with a published schema (a
// JobRequest inside a JobStatus) must come out identical to the published
// definition, or the build fails, so the document cannot drift from the
// files.
var apiTypes = []any{
	contracts.APIError{},
	contracts.SubmitResponse{},
	contracts.JobStatus{},
	contracts.JobList{},
	contracts.UsageSummary{},
	contracts.JobDescription{},
	contracts.CheckpointResponse{},
	contracts.FaultResponse{},
	contracts.NodeStatus{},
	contracts.NodeList{},
	contracts.QuotaDoc{},
	contracts.QuotaList{},
	contracts.PoolDoc{},
	contracts.PoolList{},
	contracts.PriceBookDoc{},
	contracts.BudgetDoc{},
	contracts.Invoice{},
	contracts.AuthConfig{},
	contracts.LoginRequest{},
	contracts.LoginResponse{},
	contracts.WhoAmI{},
	contracts.TokenRequest{},
	contracts.TokenCreated{},
	contracts.TokenList{},
	contracts.APIToken{},
	contracts.BindingRequest{},
	contracts.BindingList{},
	contracts.RoleBindings{},
	contracts.AuditList{},
	contracts.AuditVerification{},
	contracts.FleetEvent{},
	contracts.QueueList{},
	contracts.OpsEvent{},
	contracts.TenantList{},
	contracts.UsageSeries{},
	contracts.NodeTelemetry{},
}

// componentRef is the $ref of a component schema.
func componentRef(name string) string { return "#/components/schemas/" + name }

// schemaSet is components/schemas under construction: every definition
// of every schema, by type name, with its references rewritten from the
// file's "#/$defs/X" to "#/components/schemas/X".
type schemaSet struct {
	defs map[string]any
	// files names the published file whose root a component is.
	files map[string]string
}

// buildSchemas merges the published schemas (contracts.Schemas, the
// bytes of contracts/schema/*.json) and the API types into one set.
func buildSchemas() (*schemaSet, error) {
	set := &schemaSet{defs: map[string]any{}, files: map[string]string{}}
	published, err := contracts.Schemas()
	if err != nil {
		return nil, err
	}
	for _, file := range slices.Sorted(maps.Keys(published)) {
		root, err := set.add(file, published[file])
		if err != nil {
			return nil, err
		}
		set.files[root] = file
	}
	for _, v := range apiTypes {
		b, err := json.Marshal(contracts.Reflect(v))
		if err != nil {
			return nil, fmt.Errorf("reflect %T: %w", v, err)
		}
		if _, err := set.add(fmt.Sprintf("%T", v), b); err != nil {
			return nil, err
		}
	}
	for root, file := range set.files {
		def := set.defs[root].(map[string]any)
		def["$comment"] = "published as contracts/schema/" + file + " (https://gpuplane.dev/schemas/v1/" + file + ")"
	}
	return set, nil
}

// add merges one schema document ({"$ref": "#/$defs/Root", "$defs": ...})
// and returns its root's name.
func (s *schemaSet) add(source string, data []byte) (string, error) {
	var doc struct {
		Ref  string                     `json:"$ref"`
		Defs map[string]json.RawMessage `json:"$defs"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return "", fmt.Errorf("%s: %w", source, err)
	}
	root, ok := strings.CutPrefix(doc.Ref, "#/$defs/")
	if !ok || doc.Defs[root] == nil {
		return "", fmt.Errorf("%s: root $ref %q is not one of its $defs", source, doc.Ref)
	}
	for name, raw := range doc.Defs {
		var def any
		if err := json.Unmarshal(raw, &def); err != nil {
			return "", fmt.Errorf("%s: $defs/%s: %w", source, name, err)
		}
		def = rewriteRefs(def)
		if prev, ok := s.defs[name]; ok && !reflect.DeepEqual(prev, def) {
			return "", fmt.Errorf("%s: $defs/%s differs from the definition of the same name in an earlier schema", source, name)
		}
		s.defs[name] = def
	}
	return root, nil
}

// rewriteRefs points a schema's "#/$defs/X" references at components.
func rewriteRefs(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			if s, ok := e.(string); ok && k == "$ref" {
				if name, ok := strings.CutPrefix(s, "#/$defs/"); ok {
					v[k] = componentRef(name)
				}
				continue
			}
			v[k] = rewriteRefs(e)
		}
	case []any:
		for i, e := range v {
			v[i] = rewriteRefs(e)
		}
	}
	return v
}

// property returns the schema of a component's property, so that a path
// or query parameter states the same pattern as the body field it names.
func (s *schemaSet) property(component, prop string) map[string]any {
	def, _ := s.defs[component].(map[string]any)
	props, _ := def["properties"].(map[string]any)
	p, ok := props[prop].(map[string]any)
	if !ok {
		panic(fmt.Sprintf("openapi gen: component %s has no property %s", component, prop))
	}
	out := maps.Clone(p)
	delete(out, "description") // the field's, not the parameter's
	return out
}

// derive adds component name: a copy of component from whose required
// list optional is dropped, for a body the gateway completes before it
// decodes it as the published type.
func (s *schemaSet) derive(name, from, optional, comment string) error {
	def, ok := s.defs[from].(map[string]any)
	if !ok {
		return fmt.Errorf("derive %s: no component %s", name, from)
	}
	b, err := json.Marshal(def)
	if err != nil {
		return err
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		return err
	}
	req, _ := out["required"].([]any)
	out["required"] = slices.DeleteFunc(req, func(r any) bool { return r == optional })
	out["$comment"] = comment + " Derived from " + from + " by the generator."
	s.defs[name] = out
	return nil
}
