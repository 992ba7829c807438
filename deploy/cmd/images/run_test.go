package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/deploy/internal/images"
)

// TestImageRuns runs a dynamically linked binary from its image as a
// container would: the image's layers unpacked into a root file system,
// the process chrooted there as the image's user (65532), in its working
// directory. The binary is the probe built with cgo, so it needs the C
// library and loader the image carries (as the node agent's does): a
// missing library or a wrong path fails the exec. Needs root (chroot,
// setuid); CI runs as root.
func TestImageRuns(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chroot and change user")
	}
	if _, err := exec.LookPath("ldd"); err != nil {
		t.Skip("no ldd")
	}
	ctx := context.Background()
	root, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	base, err := images.BaseFiles("/etc/ssl/certs/ca-certificates.crt")
	if err != nil {
		t.Skipf("no CA bundle: %v", err)
	}
	build := ProbeBuild(root)
	build.Cgo = true
	spec, err := ServiceSpec(ctx, Service{Name: "probe-cgo", Build: build}, t.TempDir(), base, []byte("probe"), time.Unix(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if len(spec.Extra) == 0 {
		t.Fatal("the cgo build links no shared library: the test would prove nothing")
	}
	img, err := images.Image(spec)
	if err != nil {
		t.Fatal(err)
	}
	rootfs := t.TempDir()
	if err := images.Unpack(img, rootfs); err != nil {
		t.Fatal(err)
	}
	// A /proc/<pid>/stat of a sleeping process, where the probe can read it
	// as 65532 (a chroot has no /proc).
	fake := filepath.Join(rootfs, "tmp", "proc", "1")
	if err := os.MkdirAll(fake, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(fake, "stat"), []byte("1 (scheduler) S 0 1 1 0 -1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := images.Run(ctx, img, rootfs, "running", "-proc", "/tmp/proc", "-pid", "1"); err != nil {
		t.Fatalf("the image's binary did not run as its user: %v\n%s", err, out)
	}
	// And it really reads what it is given: a stopped process fails.
	if err := os.WriteFile(filepath.Join(fake, "stat"), []byte("1 (scheduler) T 0 1 1 0 -1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := images.Run(ctx, img, rootfs, "running", "-proc", "/tmp/proc", "-pid", "1"); err == nil || !strings.Contains(out, "stopped") {
		t.Fatalf("a stopped process passed in the image: %v\n%s", err, out)
	}
}
