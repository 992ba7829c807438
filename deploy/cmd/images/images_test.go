package main

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/gpuplane/gpuplane/deploy/internal/images"
)

// TestImageReproducible builds the probe's binary twice (separate go build
// runs into separate files) and assembles an image from each, in separate
// layouts: the digests must be equal, and the layout read back must hold
// that digest, run as 65532 with every time at the epoch, and its layers'
// tar entries must be sorted, root-owned (but /home/nonroot) and dated at
// the epoch.
func TestImageReproducible(t *testing.T) {
	ctx := context.Background()
	root, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	base, err := images.BaseFiles("/etc/ssl/certs/ca-certificates.crt")
	if err != nil {
		t.Skipf("no CA bundle on this machine: %v", err)
	}
	epoch := time.Unix(1_700_000_000, 0).UTC()
	svc := Service{Name: "probe-test", Build: ProbeBuild(root)}
	var digests []v1.Hash
	for i := range 2 {
		work := t.TempDir()
		spec, err := ServiceSpec(ctx, svc, work, base, []byte("probe"), epoch)
		if err != nil {
			t.Fatal(err)
		}
		img, err := images.Image(spec)
		if err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(t.TempDir(), "layout")
		d, err := images.WriteLayout(dir, spec.Name, img)
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, d)
		if i == 0 {
			checkLayout(t, dir, d, epoch)
		}
	}
	if digests[0] != digests[1] {
		t.Fatalf("two builds of one image differ: %s and %s", digests[0], digests[1])
	}
}

func checkLayout(t *testing.T, dir string, want v1.Hash, epoch time.Time) {
	t.Helper()
	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	img, err := p.Image(want)
	if err != nil {
		t.Fatalf("layout has no image %s: %v", want, err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.Config.User != "65532:65532" {
		t.Errorf("user %q, want 65532:65532", cf.Config.User)
	}
	if !cf.Created.Equal(epoch) {
		t.Errorf("created %v, want %v", cf.Created.Time, epoch)
	}
	for _, h := range cf.History {
		if !h.Created.Equal(epoch) {
			t.Errorf("history created %v, want %v", h.Created.Time, epoch)
		}
	}
	if cf.OS != "linux" || cf.Architecture != "amd64" {
		t.Errorf("platform %s/%s", cf.OS, cf.Architecture)
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 2 {
		t.Fatalf("%d layers, want base and binaries", len(layers))
	}
	seen := map[string]bool{}
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			names = append(names, h.Name)
			seen[h.Name] = true
			if !h.ModTime.Equal(epoch) {
				t.Errorf("%s: mtime %v, want %v", h.Name, h.ModTime, epoch)
			}
			owner := 0
			if h.Name == "home/nonroot/" {
				owner = images.NonRoot
			}
			if h.Uid != owner || h.Gid != owner {
				t.Errorf("%s: owner %d:%d, want %d", h.Name, h.Uid, h.Gid, owner)
			}
		}
		rc.Close()
		if !slices.IsSorted(names) {
			t.Errorf("tar entries not sorted: %v", names)
		}
	}
	for _, want := range []string{"etc/passwd", "etc/group", "etc/ssl/certs/ca-certificates.crt", "tmp/", "home/nonroot/",
		"usr/local/bin/gpuplane-probe", "usr/local/bin/probe-test"} {
		if !seen[want] {
			t.Errorf("image lacks %s", want)
		}
	}
}

// TestLayerIgnoresOrder: the same files given in another order make the
// same layer bytes (a map walk or a directory listing must not leak into
// the digest).
func TestLayerIgnoresOrder(t *testing.T) {
	files := []images.File{
		{Path: "/usr/local/bin/b", Data: []byte("b"), Mode: 0o755},
		{Path: "/etc/a", Data: []byte("a"), Mode: 0o644},
		{Path: "/usr/lib/c.so", Data: []byte("c"), Mode: 0o755},
	}
	epoch := time.Unix(0, 0)
	a, err := images.Layer(files, epoch, "/tmp")
	if err != nil {
		t.Fatal(err)
	}
	slices.Reverse(files)
	b, err := images.Layer(files, epoch, "/tmp")
	if err != nil {
		t.Fatal(err)
	}
	if string(a) != string(b) {
		t.Fatal("layer bytes depend on the order of the files")
	}
	if _, err := images.Layer(append(files, files[0]), epoch); err == nil {
		t.Fatal("a path given twice was accepted")
	}
}

// TestComponentRoundTrip: what WriteComponent writes, ReadComponent reads
// back, so `-only` keeps the digests of the images it did not build.
func TestComponentRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kustomization.yaml")
	want := map[string]string{
		"gpuplane/scheduler": "sha256:" + string(slices.Repeat([]byte("a"), 64)),
		"gpuplane/billing":   "sha256:" + string(slices.Repeat([]byte("b"), 64)),
	}
	if err := WriteComponent(path, want, "the working tree"); err != nil {
		t.Fatal(err)
	}
	got, err := ReadComponent(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %q, want %q", k, got[k], v)
		}
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatal(err)
	}
}
