package image_test

import (
	"archive/tar"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// TestHostileLayersFail: a layer that would write outside the image's root
// (by its entry names, or through a symlink it made) fails the pull, and
// nothing lands outside the cache.
func TestHostileLayersFail(t *testing.T) {
	outside := t.TempDir()
	victim := filepath.Join(outside, "victim")
	tests := map[string][]tarEntry{
		"dot-dot entry":          {file("../../../../../../.."+victim, "owned\n")},
		"entry through symlink":  {symlink("escape", outside), file("escape/victim", "owned\n")},
		"relative symlink climb": {symlink("up", "../../../../../../../../.."), file("up"+victim, "owned\n")},
		"hard link out":          {{name: "passwd", typ: tar.TypeLink, linkname: "../../../../../../etc/passwd"}},
	}
	reg := startRegistry(t)
	for name, entries := range tests {
		t.Run(name, func(t *testing.T) {
			img, err := mutate.AppendLayers(empty.Image, layerOf(t, entries...))
			if err != nil {
				t.Fatal(err)
			}
			ref := reg.push(t, "hostile/img:1", img, image.Auth{})
			c := newCache(t, image.Config{})
			_, _, err = c.Acquire(context.Background(), ref, image.Auth{}, nil)
			if !errors.Is(err, image.ErrPullFailed) {
				t.Errorf("Acquire = %v, want ErrPullFailed", err)
			}
			if _, err := os.Stat(victim); err == nil {
				t.Fatalf("the layer wrote %s", victim)
			}
			if len(c.Images()) != 0 {
				t.Errorf("a hostile image is cached: %+v", c.Images())
			}
		})
	}
}
