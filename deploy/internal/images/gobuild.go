package images

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// GoBuild describes one binary built from a module of the repository.
type GoBuild struct {
	// ModuleDir is the module's directory; the build runs there with
	// GOWORK=off, so the binary is what the module's own go.mod pins (the
	// workspace could select other versions).
	ModuleDir string
	// Package is the main package, relative to ModuleDir ("./cmd/billing").
	Package string
	// Cgo builds with cgo (the node agent's go-nvml); else CGO_ENABLED=0
	// and a static binary.
	Cgo bool
}

// Build compiles b into out, reproducibly: -trimpath, no VCS stamp, no
// build ID, no symbol or DWARF tables.
func (b GoBuild) Build(ctx context.Context, out string) error {
	abs, err := filepath.Abs(out)
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-buildvcs=false",
		"-ldflags=-s -w -buildid=", "-o", abs, b.Package)
	cmd.Dir = b.ModuleDir
	cgo := "0"
	if b.Cgo {
		cgo = "1"
	}
	cmd.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED="+cgo, "GOOS=linux", "GOARCH=amd64", "GOFLAGS=")
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s in %s: %w\n%s", b.Package, b.ModuleDir, err, stderr.String())
	}
	return nil
}

// SharedLibs returns the files a dynamically linked binary needs at run
// time, as ldd resolves them on the build machine (the loader, libc and
// what else it names), each at the path the binary looks it up. A static
// binary needs none. NVML itself is not among them: go-nvml opens it at
// run time, and the NVIDIA container runtime mounts the host's.
func SharedLibs(ctx context.Context, binary string) ([]File, error) {
	out, err := exec.CommandContext(ctx, "ldd", binary).CombinedOutput()
	if err != nil {
		if strings.Contains(string(out), "not a dynamic executable") {
			return nil, nil
		}
		return nil, fmt.Errorf("ldd %s: %w: %s", binary, err, out)
	}
	var files []File
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var p string
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
			p = f[2]
		case len(f) >= 1 && strings.HasPrefix(f[0], "/"):
			p = f[0]
		default:
			continue // linux-vdso.so.1 lives in the kernel
		}
		data, err := os.ReadFile(p) // follows links: the image holds a plain file
		if err != nil {
			return nil, fmt.Errorf("ldd %s: %w", binary, err)
		}
		files = append(files, File{Path: p, Data: data, Mode: 0o755})
	}
	return files, sc.Err()
}
