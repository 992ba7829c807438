package contracts

import (
	"os"
	"path/filepath"
	"testing"
)

// TestSchemasUpToDate fails when a message type changed and the published
// JSON Schema files were not regenerated with `make schemas`.
func TestSchemasUpToDate(t *testing.T) {
	schemas, err := Schemas()
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range schemas {
		got, err := os.ReadFile(filepath.Join("schema", name))
		if err != nil {
			t.Errorf("%s: %v (run `make schemas`)", name, err)
			continue
		}
		if string(got) != string(want) {
			t.Errorf("schema/%s is stale: run `make schemas`", name)
		}
	}
	files, _ := filepath.Glob(filepath.Join("schema", "*.json"))
	for _, f := range files {
		if _, ok := schemas[filepath.Base(f)]; !ok {
			t.Errorf("%s has no message type: delete it or add it to schemaTypes", f)
		}
	}
}
