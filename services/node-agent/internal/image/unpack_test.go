package image_test

import (
	"archive/tar"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// TestHostileLayersStayInside: a layer that would write outside the
// image's root, by its entry names or through a symlink it made, either
// fails the pull or writes inside the root (where a container resolving
// the same symlink against its root finds it); never outside.
func TestHostileLayersStayInside(t *testing.T) {
	outside := t.TempDir()
	victim := filepath.Join(outside, "victim")
	tests := map[string]struct {
		entries []tarEntry
		fails   bool
		inside  string // where the file lands in the root when it does not fail
	}{
		"dot-dot entry": {entries: []tarEntry{file("../../../../../../.."+victim, "owned\n")}, fails: true},
		"hard link out": {entries: []tarEntry{{name: "passwd", typ: tar.TypeLink, linkname: "../../../../../../etc/passwd"}}, fails: true},
		"through an absolute symlink": {
			entries: []tarEntry{symlink("escape", outside), file("escape/victim", "owned\n")},
			inside:  strings.TrimPrefix(victim, "/"),
		},
		"through a symlink that climbs": {
			entries: []tarEntry{symlink("up", "../../../../../../../../.."), file("up"+victim, "owned\n")},
			inside:  strings.TrimPrefix(victim, "/"),
		},
	}
	reg := startRegistry(t)
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			img, err := mutate.AppendLayers(empty.Image, layerOf(t, tt.entries...))
			if err != nil {
				t.Fatal(err)
			}
			ref := reg.push(t, "hostile/img:1", img, image.Auth{})
			c := newCache(t, image.Config{})
			got, release, err := c.Acquire(context.Background(), ref, image.Auth{}, nil)
			if _, serr := os.Stat(victim); serr == nil {
				t.Fatalf("the layer wrote %s", victim)
			}
			switch {
			case tt.fails:
				if !errors.Is(err, image.ErrPullFailed) {
					t.Errorf("Acquire = %v, want ErrPullFailed", err)
				}
				if len(c.Images()) != 0 {
					t.Errorf("a hostile image is cached: %+v", c.Images())
				}
			case err != nil:
				t.Errorf("Acquire = %v", err)
			default:
				defer release()
				if b, err := os.ReadFile(filepath.Join(got.RootFS, tt.inside)); err != nil || string(b) != "owned\n" {
					t.Errorf("%s in the root: %q, %v; want the layer's file", tt.inside, b, err)
				}
			}
		})
	}
}

// TestAbsoluteSymlinkDirectories: layers that write and delete through a
// directory symlink to an absolute path (Debian's /var/run → /run) act
// where a container sees it.
func TestAbsoluteSymlinkDirectories(t *testing.T) {
	reg := startRegistry(t)
	img, err := mutate.AppendLayers(empty.Image,
		layerOf(t, dir("run/"), dir("var/"), symlink("var/run", "/run"), file("run/old.pid", "1\n"),
			dir("usr/"), dir("usr/lib/"), symlink("lib", "usr/lib")),
		layerOf(t, file("var/run/app.pid", "42\n"), file("var/run/.wh.old.pid", ""), file("lib/libx.so", "elf\n"),
			tarEntry{name: "var/run/app.link", typ: tar.TypeLink, linkname: "var/run/app.pid"}),
	)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.push(t, "team/symlinks:1", img, image.Auth{})
	c := newCache(t, image.Config{})
	got, release := acquire(t, c, ref, image.Auth{})
	defer release()
	for p, want := range map[string]string{"run/app.pid": "42\n", "run/app.link": "42\n", "usr/lib/libx.so": "elf\n"} {
		if b, err := os.ReadFile(filepath.Join(got.RootFS, p)); err != nil || string(b) != want {
			t.Errorf("%s: %q, %v; want %q", p, b, err, want)
		}
	}
	if _, err := os.Lstat(filepath.Join(got.RootFS, "run/old.pid")); err == nil {
		t.Error("run/old.pid survived its whiteout through var/run")
	}
	if l, err := os.Readlink(filepath.Join(got.RootFS, "var/run")); err != nil || l != "/run" {
		t.Errorf("var/run links to %q (%v), want /run", l, err)
	}
}
