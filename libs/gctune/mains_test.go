package gctune

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestEveryServiceMainTunes: each service binary of the tree (a main
// package under services/*/cmd that runs service.Main) calls Tune, so the
// separate services the Tiltfile and the Kubernetes deploy run collect as
// the all-in-one does. A new service main without it fails here.
func TestEveryServiceMainTunes(t *testing.T) {
	mains, err := filepath.Glob(filepath.Join("..", "..", "services", "*", "cmd", "*", "main.go"))
	if err != nil {
		t.Fatal(err)
	}
	services := 0
	for _, f := range mains {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src := string(b)
		if !strings.Contains(src, "service.Main(") {
			continue // a tool (gpuctl, creds, simulators), not a service
		}
		services++
		if !strings.Contains(src, "gctune.Tune(") {
			t.Errorf("%s runs service.Main but never calls gctune.Tune", f)
		}
	}
	if services == 0 {
		t.Skip("no service mains found beside this module (not the monorepo's tree)")
	}
	t.Logf("%d service mains tune the collector", services)
}
