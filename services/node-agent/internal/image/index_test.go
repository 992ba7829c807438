package image_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// pushIndex uploads a multi-platform index of imgs (one per platform) as
// repoTag and returns the index's digest.
func pushIndex(t *testing.T, reg *testRegistry, repoTag string, imgs map[string]v1.Image) string {
	t.Helper()
	var adds []mutate.IndexAddendum
	for arch, img := range imgs {
		adds = append(adds, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			Platform: &v1.Platform{OS: "linux", Architecture: arch}}})
	}
	idx := mutate.AppendManifests(empty.Index, adds...)
	ref, err := name.ParseReference(reg.host + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(ref, idx); err != nil {
		t.Fatal(err)
	}
	d, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d.String()
}

// archImage is the busybox image relabelled for another architecture.
func archImage(t *testing.T, id, arch string) v1.Image {
	t.Helper()
	img := busyboxImage(t, id)
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.Architecture = arch
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestMultiPlatformIndex: most public images are indexes of several
// platforms; the cache takes the linux/amd64 one, caches it under its own
// digest, and says image not found where the index has none.
func TestMultiPlatformIndex(t *testing.T) {
	reg := startRegistry(t)
	amd64 := busyboxImage(t, "amd64")
	arm64 := archImage(t, "arm64", "arm64")
	both := pushIndex(t, reg, "team/multi:1", map[string]v1.Image{"amd64": amd64, "arm64": arm64})
	pushIndex(t, reg, "team/armonly:1", map[string]v1.Image{"arm64": arm64})
	reg.push(t, "team/armimage:1", arm64, image.Auth{})
	c := newCache(t, image.Config{})

	got, release := acquire(t, c, reg.host+"/team/multi:1", image.Auth{})
	release()
	want, err := amd64.Digest()
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest != want.String() {
		t.Errorf("digest %s, want the amd64 image's %s", got.Digest, want)
	}
	if b, err := os.ReadFile(filepath.Join(got.RootFS, "id")); err != nil || strings.TrimSpace(string(b)) != "amd64" {
		t.Errorf("the root is not the amd64 image's: %q, %v", b, err)
	}
	// By the index's digest: from the cache, no download.
	reg.reset()
	byIndex, release := acquire(t, c, reg.host+"/team/multi@"+both, image.Auth{})
	release()
	if byIndex.RootFS != got.RootFS || reg.count("GET blob") != 0 {
		t.Errorf("by the index digest: %s after %d blob downloads; want the cached %s", byIndex.RootFS, reg.count("GET blob"), got.RootFS)
	}

	for _, ref := range []string{reg.host + "/team/armonly:1", reg.host + "/team/armimage:1"} {
		if _, _, err := c.Acquire(context.Background(), ref, image.Auth{}, nil); !errors.Is(err, image.ErrNotFound) {
			t.Errorf("%s: %v, want ErrNotFound (no linux/amd64 image)", ref, err)
		}
	}
}

// TestCorruptBlobFails: a layer whose bytes do not match its digest fails
// the pull and leaves nothing cached.
func TestCorruptBlobFails(t *testing.T) {
	reg := startRegistry(t)
	img := busyboxImage(t, "one")
	reg.push(t, "team/busybox:1", img, image.Auth{})
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	d, err := layers[1].Digest()
	if err != nil {
		t.Fatal(err)
	}
	reg.mu.Lock()
	reg.corrupt = d.String()
	reg.mu.Unlock()
	c := newCache(t, image.Config{})
	if _, _, err := c.Acquire(context.Background(), reg.host+"/team/busybox:1", image.Auth{}, nil); !errors.Is(err, image.ErrPullFailed) {
		t.Fatalf("Acquire = %v, want ErrPullFailed", err)
	}
	if len(c.Images()) != 0 {
		t.Errorf("a corrupt image is cached: %+v", c.Images())
	}
}

// TestAbandonedPullStops: when every waiter gives up, the pull stops and
// leaves nothing behind; the next Acquire pulls afresh.
func TestAbandonedPullStops(t *testing.T) {
	reg := startRegistry(t)
	img := busyboxImage(t, "one")
	reg.push(t, "team/busybox:1", img, image.Auth{})
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	first, err := layers[0].Digest()
	if err != nil {
		t.Fatal(err)
	}
	reg.mu.Lock()
	reg.stall = first.String()
	reg.mu.Unlock()
	dir := t.TempDir()
	c := newCache(t, image.Config{Dir: dir})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, _, err := c.Acquire(ctx, reg.host+"/team/busybox:1", image.Auth{}, nil)
		errc <- err
	}()
	eventually(t, "the pull writes bin/busybox", func() bool {
		m, _ := filepath.Glob(filepath.Join(dir, "tmp", "*", "rootfs", "bin", "busybox"))
		return len(m) == 1
	})
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire = %v, want context.Canceled", err)
	}
	c.Close() // the pull has stopped
	if m, _ := filepath.Glob(filepath.Join(dir, "*", "*")); len(m) != 0 {
		t.Errorf("an abandoned pull left %v (in images/, tmp/ or leases/)", m)
	}
	reg.mu.Lock()
	reg.stall = ""
	reg.mu.Unlock()
	_, release := acquire(t, c, reg.host+"/team/busybox:1", image.Auth{})
	release()
}
