// Package ocitest gives tests a real runc and a busybox image built on the
// spot, so container runs are tested for real: no registry, no mock.
package ocitest

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
)

// RequireEnv makes a missing runc, busybox or root a failure instead of a
// skip: CI sets it, where .ci/run installs both and runs as root.
const RequireEnv = "GPUPLANE_REQUIRE_RUNC"

// Runtime returns runc with a state root of the test's own. It skips the
// test, saying why, where containers cannot run (not root, no runc), and
// fails it instead when GPUPLANE_REQUIRE_RUNC=1.
func Runtime(t testing.TB) oci.Runtime {
	t.Helper()
	unable := func(why string) {
		t.Helper()
		if os.Getenv(RequireEnv) == "1" {
			t.Fatalf("%s, and %s=1 requires container tests to run", why, RequireEnv)
		}
		msg := fmt.Sprintf("container tests skipped: %s (install runc and busybox-static and run as root; %s=1 makes this a failure)", why, RequireEnv)
		reportSkip(msg)
		t.Skip(msg)
	}
	if os.Geteuid() != 0 {
		unable("not root: runc needs root to create containers")
	}
	rt, err := oci.LookRuntime("", filepath.Join(t.TempDir(), "runc"))
	if err != nil {
		unable(err.Error())
	}
	if _, err := Busybox(); err != nil {
		unable(err.Error())
	}
	return rt
}

// reportSkip appends why to GPUPLANE_SKIP_REPORT, which make test shows
// (go test without -v hides skips), once per reason.
func reportSkip(why string) {
	path := os.Getenv("GPUPLANE_SKIP_REPORT")
	if path == "" {
		return
	}
	line := "node-agent: " + why + "\n"
	if b, err := os.ReadFile(path); err == nil && bytes.Contains(b, []byte(line)) {
		return
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return
	}
	_, _ = f.WriteString(line)
	_ = f.Close()
}

// Busybox is the path of a statically linked busybox (Debian's
// busybox-static), which runs in an image holding nothing else.
func Busybox() (string, error) {
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		f, err := elf.Open(p)
		if err != nil {
			continue
		}
		static := true
		for _, prog := range f.Progs {
			if prog.Type == elf.PT_INTERP {
				static = false // needs a dynamic loader the image lacks
			}
		}
		_ = f.Close()
		if static {
			return p, nil
		}
	}
	return "", errors.New("no statically linked busybox in /bin or /usr/bin (Debian: busybox-static)")
}

// Image builds a busybox image root in a directory of the test: busybox
// and its applets' links in /bin, /etc/passwd and /etc/group with root,
// nobody and app (1000:1000), a world-writable /tmp. Its config runs sh
// as root (the runtime must not).
func Image(t testing.TB) oci.Image {
	t.Helper()
	bb, err := Busybox()
	if err != nil {
		t.Fatalf("busybox: %v", err)
	}
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev", "home/app", "data", "scratch", "signal"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(root, "tmp"), 0o1777); err != nil {
		t.Fatal(err)
	}
	// /work is any user's to write: where the root is the run's own
	// (overlay) a job writes there, and never into the image.
	if err := os.Mkdir(filepath.Join(root, "work"), 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(root, "work"), 0o777); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin/busybox"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, applet := range []string{"sh", "ps", "cat", "id", "sleep", "ls", "echo", "touch", "test", "grep", "wc", "trap", "kill", "hostname", "mount", "true", "false", "env", "head", "tr"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", applet)); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":  "root:x:0:\napp:x:1000:\nstaff:x:50:app\nnogroup:x:65534:\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(root, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return oci.Image{Ref: "test/busybox:latest", Digest: "sha256:test", RootFS: root, Cmd: []string{"/bin/sh"},
		Env: []string{"PATH=/bin", "IMAGE_VAR=image"}}
}

// OCIImage packs the root of img (Image's busybox) as a one-layer
// linux/amd64 OCI image with img's config, for a registry to serve.
func OCIImage(t testing.TB, img oci.Image) v1.Image {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.Walk(img.RootFS, func(p string, fi os.FileInfo, err error) error {
		if err != nil || p == img.RootFS {
			return err
		}
		link := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(img.RootFS, p)
		h.Name = rel
		if fi.IsDir() {
			h.Name += "/"
		}
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			_, err = tw.Write(b)
			return err
		}
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		t.Fatalf("pack the image: %v", err)
	}
	data := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
	if err != nil {
		t.Fatal(err)
	}
	v, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := v.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Entrypoint, cf.Config.Cmd, cf.Config.Env = img.Entrypoint, img.Cmd, img.Env
	cf.Config.User, cf.Config.WorkingDir = img.User, img.WorkingDir
	v, err = mutate.ConfigFile(v, cf)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
