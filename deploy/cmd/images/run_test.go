package main

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

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
	// "/" of the container: 65532 must be able to walk it.
	if err := os.Chmod(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unpack(img, rootfs); err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	uid, gid := parseUser(t, cf.Config.User)
	// A /proc/<pid>/stat of a sleeping process, where the probe can read it
	// as 65532 (a chroot has no /proc).
	fake := filepath.Join(rootfs, "tmp", "proc", "1")
	if err := os.MkdirAll(fake, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(fake, "stat"), []byte("1 (scheduler) S 0 1 1 0 -1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(args ...string) (string, error) {
		cmd := exec.Command(cf.Config.Entrypoint[0], args...)
		cmd.Path = cf.Config.Entrypoint[0] // resolved inside the chroot
		cmd.Dir = cf.Config.WorkingDir
		cmd.Env = cf.Config.Env
		cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: rootfs, Credential: &syscall.Credential{Uid: uid, Gid: gid}}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run("running", "-proc", "/tmp/proc", "-pid", "1"); err != nil {
		t.Fatalf("the image's binary did not run as %d:%d: %v\n%s", uid, gid, err, out)
	}
	// And it really reads what it is given: a stopped process fails.
	if err := os.WriteFile(filepath.Join(fake, "stat"), []byte("1 (scheduler) T 0 1 1 0 -1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := run("running", "-proc", "/tmp/proc", "-pid", "1"); err == nil || !strings.Contains(out, "stopped") {
		t.Fatalf("a stopped process passed in the image: %v\n%s", err, out)
	}
}

func parseUser(t *testing.T, user string) (uint32, uint32) {
	t.Helper()
	u, g, ok := strings.Cut(user, ":")
	uid, err1 := strconv.ParseUint(u, 10, 32)
	gid, err2 := strconv.ParseUint(g, 10, 32)
	if !ok || err1 != nil || err2 != nil || uid == 0 {
		t.Fatalf("image user %q: want a numeric non-root uid:gid", user)
	}
	return uint32(uid), uint32(gid)
}

// unpack writes the image's flattened file system into dir, with the
// owners and modes of its tar entries.
func unpack(img v1.Image, dir string) error {
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
			if err != nil {
				return err
			}
			if _, err := io.Copy(f, tr); err != nil {
				f.Close()
				return err
			}
			if err := f.Close(); err != nil {
				return err
			}
		default:
			continue
		}
		if err := os.Chown(p, h.Uid, h.Gid); err != nil {
			return err
		}
		if err := os.Chmod(p, os.FileMode(h.Mode)&os.ModePerm|modeBits(h.Mode)); err != nil {
			return err
		}
	}
}

// modeBits carries the sticky bit (/tmp is 1777).
func modeBits(mode int64) os.FileMode {
	if mode&0o1000 != 0 {
		return os.ModeSticky
	}
	return 0
}
