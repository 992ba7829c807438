package main

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"
)

// TestDocumentUpToDate fails when the committed document is not what the
// operation table and the contracts types generate (a type, a schema rule
// or an operation changed without `go generate ./contracts/openapi` or
// `make schemas`).
func TestDocumentUpToDate(t *testing.T) {
	want, err := build()
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("../gateway.openapi.json")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("contracts/openapi/gateway.openapi.json is stale: run `make schemas` (or go generate ./contracts/openapi)")
	}
}

// TestEveryRefResolves walks the document: every $ref names a component
// that exists, and every published schema file's root is a component.
func TestEveryRefResolves(t *testing.T) {
	b, err := build()
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	schemas := doc["components"].(map[string]any)["schemas"].(map[string]any)
	refs := 0
	var walk func(at string, v any)
	walk = func(at string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, e := range v {
				if k == "$ref" {
					refs++
					name, ok := strings.CutPrefix(e.(string), "#/components/schemas/")
					if !ok || schemas[name] == nil {
						t.Errorf("%s: $ref %v resolves to nothing", at, e)
					}
					continue
				}
				walk(at+"/"+k, e)
			}
		case []any:
			for _, e := range v {
				walk(at, e)
			}
		}
	}
	walk("", doc)
	if refs < 100 {
		t.Fatalf("only %d $refs: the document lost its schemas", refs)
	}
	set, err := buildSchemas()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"job-request.json", "job-event.json", "node-admin-request.json", "fault-request.json",
		"tenant-quota.json", "pool-config.json", "price-book.json", "budget.json"} {
		found := false
		for _, file := range set.files {
			found = found || file == name
		}
		if !found {
			t.Errorf("published schema %s is not a component", name)
		}
	}
}

// TestConflictingDefinitionsRefused checks the guard that keeps one source
// of truth: a definition that differs from one of the same name is an
// error, not silently one or the other.
func TestConflictingDefinitionsRefused(t *testing.T) {
	set := &schemaSet{defs: map[string]any{}, files: map[string]string{}}
	a := `{"$ref":"#/$defs/A","$defs":{"A":{"type":"object","properties":{"b":{"$ref":"#/$defs/B"}}},"B":{"type":"string"}}}`
	if _, err := set.add("a", []byte(a)); err != nil {
		t.Fatal(err)
	}
	if got := set.defs["A"].(map[string]any)["properties"].(map[string]any)["b"].(map[string]any)["$ref"]; got != "#/components/schemas/B" {
		t.Fatalf("ref not rewritten: %v", got)
	}
	same := `{"$ref":"#/$defs/C","$defs":{"C":{"type":"integer"},"B":{"type":"string"}}}`
	if _, err := set.add("same", []byte(same)); err != nil {
		t.Fatalf("an identical definition refused: %v", err)
	}
	other := `{"$ref":"#/$defs/D","$defs":{"D":{"type":"integer"},"B":{"type":"integer"}}}`
	if _, err := set.add("other", []byte(other)); err == nil {
		t.Fatal("a conflicting definition of B was accepted")
	}
}
