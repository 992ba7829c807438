package gpuplane

import (
	"archive/tar"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// TestBuiltinRegistry: the busybox image the all-in-one builds is served
// by its registry through the agents' transport (no socket), with the
// config and files a container needs, reproducibly; other registries
// are reached through the next transport.
func TestBuiltinRegistry(t *testing.T) {
	bb, err := FindBusybox()
	if err != nil {
		t.Skipf("no static busybox: %v", err)
	}
	r := NewLocalRegistry()
	img, err := BusyboxImage(bb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Push(BusyboxRef, img); err != nil {
		t.Fatal(err)
	}
	again, err := BusyboxImage(bb, nil)
	if err != nil {
		t.Fatal(err)
	}
	other, err := BusyboxImage(bb, map[string]string{"data/marker": "2"})
	if err != nil {
		t.Fatal(err)
	}
	d1, _ := img.Digest()
	d2, _ := again.Digest()
	d3, _ := other.Digest()
	if d1 != d2 || d1 == d3 {
		t.Errorf("digests %s, %s (same busybox) and %s (an extra file): want the first two equal, the third not", d1, d2, d3)
	}

	ref, err := name.ParseReference(BusyboxRef)
	if err != nil {
		t.Fatal(err)
	}
	pulled, err := remote.Image(ref, remote.WithTransport(r.Transport(nil)))
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := pulled.Digest(); d != d1 {
		t.Errorf("pulled %s, pushed %s", d, d1)
	}
	cf, err := pulled.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || strings.Join(cf.Config.Cmd, " ") != "sh" || strings.Join(cf.Config.Env, " ") != "PATH=/bin" {
		t.Errorf("config: os %s cmd %v env %v", cf.OS, cf.Config.Cmd, cf.Config.Env)
	}
	files := map[string]*tar.Header{}
	tr := tar.NewReader(mutate.Extract(pulled))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		files[strings.TrimSuffix(h.Name, "/")] = h
	}
	for name, want := range map[string]byte{"bin/busybox": tar.TypeReg, "bin/sh": tar.TypeSymlink, "bin/id": tar.TypeSymlink,
		"etc/passwd": tar.TypeReg, "tmp": tar.TypeDir} {
		if h := files[name]; h == nil || h.Typeflag != want {
			t.Errorf("%s: %+v, want type %c", name, h, want)
		}
	}
	if h := files["tmp"]; h != nil && h.Mode != 0o1777 {
		t.Errorf("/tmp mode %o, want 1777", h.Mode)
	}

	// Any other registry goes to the next transport.
	var asked string
	next := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		asked = req.URL.Host
		return nil, errors.New("offline")
	})
	if _, err := remote.Image(name.MustParseReference("registry.example/team/train:v1"), remote.WithTransport(r.Transport(next))); err == nil || asked != "registry.example" {
		t.Errorf("a pull from registry.example: err %v, the next transport saw %q", err, asked)
	}
	if err := r.Push("registry.example/x:y", img); err == nil {
		t.Error("pushed to registry.example through the built-in registry")
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
