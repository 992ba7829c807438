package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestJaegerSkipSaysWhy: the trace tests skip without a Jaeger binary,
// and `make test` (go test without -v) hid why. The reason names the
// absolute path looked at and where it came from, what is wrong with it,
// and how to build it; a skip appends it to GPUPLANE_SKIP_REPORT, which
// the Makefile prints.
func TestJaegerSkipSaysWhy(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "nope", "jaeger")
	plain := filepath.Join(dir, "plain")
	exe := filepath.Join(dir, "jaeger")
	for path, mode := range map[string]os.FileMode{plain: 0o644, exe: 0o755} {
		if err := os.WriteFile(path, []byte("#!/bin/sh\n"), mode); err != nil {
			t.Fatal(err)
		}
	}
	const build = "build it with `make jaeger` (tilt/install-tools.sh --with-jaeger"
	tests := []struct {
		name, env string
		bin       string
		why       []string // parts of the reason, in order; none: found
	}{
		{"missing", missing, "", []string{"no Jaeger binary at " + missing + " (GPUPLANE_JAEGER_BIN): ", build}},
		{"a directory", dir, "", []string{dir + " (GPUPLANE_JAEGER_BIN) is not an executable file: ", build}},
		{"not executable", plain, "", []string{plain + " (GPUPLANE_JAEGER_BIN) is not an executable file: ", build}},
		{"there", exe, exe, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("GPUPLANE_JAEGER_BIN", tc.env)
			bin, why := findJaeger()
			if bin != tc.bin || !inOrder(why, tc.why) || (len(tc.why) == 0) != (why == "") {
				t.Fatalf("findJaeger() = %q, %q; want %q and a reason with %q", bin, why, tc.bin, tc.why)
			}
		})
	}

	// The default path is the repository's .tools/bin/jaeger, absolute.
	t.Setenv("GPUPLANE_JAEGER_BIN", "")
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if bin, why := findJaeger(); bin == "" && !strings.HasPrefix(why, "no Jaeger binary at "+filepath.Join(root, ".tools", "bin", "jaeger")+
		" (the default; GPUPLANE_JAEGER_BIN overrides it): ") {
		t.Errorf("default: %q", why)
	}

	// A skip is reported where make test shows it.
	report := filepath.Join(dir, "skips")
	t.Setenv(EnvSkipReport, report)
	t.Setenv(EnvRequireJaeger, "")
	t.Setenv("GPUPLANE_JAEGER_BIN", missing)
	var skipped bool
	t.Run("skips", func(t *testing.T) {
		defer func() { skipped = t.Skipped() }()
		jaegerBinary(t)
	})
	got, err := os.ReadFile(report)
	if err != nil {
		t.Fatalf("no skip report: %v", err)
	}
	want := "SKIP e2e TestJaegerSkipSaysWhy/skips: no Jaeger binary at " + missing + " (GPUPLANE_JAEGER_BIN): " + build
	if !skipped || !strings.HasPrefix(string(got), want) || strings.Count(string(got), "\n") != 1 {
		t.Fatalf("skipped %v, report:\n%s\nwant one line starting %q", skipped, got, want)
	}
}

// inOrder reports whether s holds every part, in order.
func inOrder(s string, parts []string) bool {
	for _, p := range parts {
		i := strings.Index(s, p)
		if i < 0 {
			return false
		}
		s = s[i+len(p):]
	}
	return true
}
