package image_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// The crash helper: this test binary, started again with these variables,
// pulls one image and is killed in the middle.
const (
	crashDirEnv = "GPUPLANE_IMAGE_CRASH_DIR"
	crashRefEnv = "GPUPLANE_IMAGE_CRASH_REF"
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(crashDirEnv); dir != "" {
		c, err := image.New(image.Config{Dir: dir})
		if err == nil {
			_, _, err = c.Acquire(context.Background(), os.Getenv(crashRefEnv), image.Auth{}, nil)
		}
		fmt.Fprintln(os.Stderr, "crash helper: the pull returned instead of stalling:", err)
		os.Exit(3)
	}
	os.Exit(m.Run())
}

// TestCrashMidUnpackLeavesNoImage: an agent killed (SIGKILL) while it
// unpacks an image leaves nothing that looks like the image, and the next
// agent pulls it whole.
func TestCrashMidUnpackLeavesNoImage(t *testing.T) {
	reg := startRegistry(t)
	img := busyboxImage(t, "one")
	ref := reg.host + "/team/busybox:1"
	reg.push(t, "team/busybox:1", img, image.Auth{})
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	first, err := layers[0].Digest() // the one with busybox in it
	if err != nil {
		t.Fatal(err)
	}
	reg.mu.Lock()
	reg.stall = first.String()
	reg.mu.Unlock()

	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashDirEnv+"="+dir, crashRefEnv+"="+ref)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	// Mid-unpack: busybox is being written, half of its layer downloaded.
	eventually(t, "the helper writes bin/busybox", func() bool {
		m, _ := filepath.Glob(filepath.Join(dir, "tmp", "*", "rootfs", "bin", "busybox"))
		return len(m) == 1
	})
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if m, _ := filepath.Glob(filepath.Join(dir, "images", "*")); len(m) != 0 {
		t.Fatalf("a killed unpack left %v in images/", m)
	}

	reg.mu.Lock()
	reg.stall = ""
	reg.mu.Unlock()
	c := newCache(t, image.Config{Dir: dir})
	if got := c.Images(); len(got) != 0 {
		t.Fatalf("after the crash the cache lists %+v", got)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, "tmp", "*")); len(m) != 0 {
		t.Errorf("the restarted cache kept the crash's leftovers %v", m)
	}
	got, release := acquire(t, c, ref, image.Auth{})
	defer release()
	bb, _ := os.ReadFile("/bin/busybox")
	if st, err := os.Stat(filepath.Join(got.RootFS, "bin/busybox")); err != nil || st.Size() != int64(len(bb)) {
		t.Errorf("bin/busybox after the crash and a new pull: %v, %v; want %d bytes", st, err, len(bb))
	}
}

// TestRebootDropsUnsyncedImages: an image is written to disk after its
// pull, in the background, then marked; a machine that lost power before
// the mark may have half written it, and the next boot drops it. A
// process that died before the mark, on the same boot, keeps it.
func TestRebootDropsUnsyncedImages(t *testing.T) {
	reg := startRegistry(t)
	refs := map[string]string{}
	for _, id := range []string{"synced", "unsynced"} {
		reg.push(t, "team/"+id+":1", busyboxImage(t, id), image.Auth{})
		refs[id] = reg.host + "/team/" + id + ":1"
	}
	dir := t.TempDir()
	c := newCache(t, image.Config{Dir: dir, BootID: "boot-1"})
	roots := map[string]string{}
	for id, ref := range refs {
		img, release := acquire(t, c, ref, image.Auth{})
		release()
		roots[id] = img.RootFS
	}
	c.Close() // the background syncs are done
	for id, root := range roots {
		if _, err := os.Stat(filepath.Join(filepath.Dir(root), "synced")); err != nil {
			t.Fatalf("image %s not marked synced after its pull: %v", id, err)
		}
	}
	// Power lost before the second image's sync returned.
	if err := os.Remove(filepath.Join(filepath.Dir(roots["unsynced"]), "synced")); err != nil {
		t.Fatal(err)
	}

	same := newCache(t, image.Config{Dir: dir, BootID: "boot-1"})
	if n := len(same.Images()); n != 2 {
		t.Fatalf("after a process crash on the same boot: %d images, want both", n)
	}
	same.Close()
	if err := os.Remove(filepath.Join(filepath.Dir(roots["unsynced"]), "synced")); err != nil {
		t.Fatalf("the same boot's start did not sync and mark the image again: %v", err)
	}

	after := newCache(t, image.Config{Dir: dir, BootID: "boot-2"})
	got := after.Images()
	if len(got) != 1 || got[0].RootFS != roots["synced"] {
		t.Fatalf("after a reboot: %+v; want only the synced image", got)
	}
	if _, err := os.Stat(roots["unsynced"]); !os.IsNotExist(err) {
		t.Errorf("the unsynced image's root is still there: %v", err)
	}
	// It is pulled again when asked for.
	img, release := acquire(t, after, refs["unsynced"], image.Auth{})
	release()
	if _, err := os.Stat(filepath.Join(img.RootFS, "bin", "busybox")); err != nil {
		t.Errorf("pulled again: %v", err)
	}
}
