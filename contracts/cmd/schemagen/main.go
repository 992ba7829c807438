// Command schemagen writes the JSON Schema files of every message in
// contracts/ to a directory (default contracts/schema), for non-Go clients.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/gpuplane/gpuplane/contracts"
)

func main() {
	dir := flag.String("out", "schema", "directory to write the schema files to")
	flag.Parse()
	if err := run(*dir); err != nil {
		fmt.Fprintln(os.Stderr, "schemagen:", err)
		os.Exit(1)
	}
}

func run(dir string) error {
	schemas, err := contracts.Schemas()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	for name, b := range schemas {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return fmt.Errorf("write %s: %w", name, err)
		}
	}
	return nil
}
