// Package images assembles gpuplane's OCI images without a container
// daemon or a registry: a distroless-style base made from files of the
// build machine (passwd and group with the nonroot user 65532, the CA
// bundle, an empty /tmp), one layer of binaries, and a config that runs
// as 65532. The result is written as an OCI image layout.
//
// Every image is reproducible: tar entries are sorted and carry fixed
// owners, modes and mtimes (SOURCE_DATE_EPOCH, 0 by default), the config
// holds no timestamp but that epoch, and gzip writes no name or time, so
// the same inputs give the same digest on any machine.
package images

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// NonRoot is the user and group every image runs as (distroless's
// "nonroot"): the manifests' runAsUser and the systemd units agree.
const NonRoot = 65532

// File is one regular file of a layer.
type File struct {
	// Path inside the image, absolute ("/usr/local/bin/scheduler").
	Path string
	// Data is the content.
	Data []byte
	// Mode is the permission bits (0o755 for binaries).
	Mode int64
}

// Spec describes one image.
type Spec struct {
	// Name is the image's name ("gpuplane/scheduler"), written as the
	// layout's org.opencontainers.image.ref.name annotation.
	Name string
	// Base is the base layer's files (see BaseFiles).
	Base []File
	// Extra is an optional layer between the base and the binaries (the
	// C library of a cgo binary); nil for none.
	Extra []File
	// Binaries is the top layer.
	Binaries []File
	// Entrypoint of the container.
	Entrypoint []string
	// Epoch is every timestamp in the image (SOURCE_DATE_EPOCH).
	Epoch time.Time
	// Labels go into the config (OCI annotations such as the source).
	Labels map[string]string
}

// BaseFiles is the distroless-style base: root and nonroot users, the CA
// bundle at caBundle (read from the build machine), /tmp and /home/nonroot
// as directories (written by Layer). Services that read a time zone carry
// Go's embedded tzdata instead of /usr/share/zoneinfo.
func BaseFiles(caBundle string) ([]File, error) {
	ca, err := os.ReadFile(caBundle)
	if err != nil {
		return nil, fmt.Errorf("base: CA bundle: %w", err)
	}
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", NonRoot, NonRoot)
	group := fmt.Sprintf("root:x:0:\nnobody:x:65534:\nnonroot:x:%d:\n", NonRoot)
	return []File{
		{Path: "/etc/passwd", Data: []byte(passwd), Mode: 0o644},
		{Path: "/etc/group", Data: []byte(group), Mode: 0o644},
		{Path: "/etc/nsswitch.conf", Data: []byte("hosts: files dns\n"), Mode: 0o644},
		{Path: "/etc/ssl/certs/ca-certificates.crt", Data: ca, Mode: 0o644},
	}, nil
}

// Layer is an uncompressed tar of files and the directories above them,
// sorted by path, owned by root except /home/nonroot, every time at epoch.
// /tmp (1777) and /home/nonroot are always present.
func Layer(files []File, epoch time.Time, withDirs ...string) ([]byte, error) {
	dirs := map[string]bool{}
	for _, d := range withDirs {
		dirs[strings.TrimPrefix(path.Clean(d), "/")] = true
	}
	byPath := map[string]File{}
	for _, f := range files {
		p := strings.TrimPrefix(path.Clean(f.Path), "/")
		if p == "" || p == "." {
			return nil, fmt.Errorf("layer: bad path %q", f.Path)
		}
		if _, dup := byPath[p]; dup {
			return nil, fmt.Errorf("layer: %s twice", f.Path)
		}
		byPath[p] = f
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	names := make([]string, 0, len(dirs)+len(byPath))
	for d := range dirs {
		names = append(names, d)
	}
	for p := range byPath {
		names = append(names, p)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		hdr := &tar.Header{Name: n, ModTime: epoch, Format: tar.FormatPAX, Uname: "root", Gname: "root"}
		if f, ok := byPath[n]; ok {
			hdr.Typeflag, hdr.Mode, hdr.Size = tar.TypeReg, f.Mode, int64(len(f.Data))
		} else {
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, n+"/", 0o755
			switch n {
			case "tmp":
				hdr.Mode = 0o1777
			case "home/nonroot":
				hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname, hdr.Mode = NonRoot, NonRoot, "nonroot", "nonroot", 0o700
			}
		}
		// PAX would record access and change times unless they are zero.
		hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("layer %s: %w", n, err)
		}
		if f, ok := byPath[n]; ok {
			if _, err := tw.Write(f.Data); err != nil {
				return nil, fmt.Errorf("layer %s: %w", n, err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func ociLayer(tarData []byte) (v1.Layer, error) {
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(tarData)), nil
	}, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
}

// Image assembles the image of s.
func Image(s Spec) (v1.Image, error) {
	if s.Name == "" || len(s.Entrypoint) == 0 || len(s.Binaries) == 0 {
		return nil, fmt.Errorf("image %q: name, entrypoint and binaries are required", s.Name)
	}
	groups := [][]File{s.Base, s.Extra, s.Binaries}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	for i, files := range groups {
		if files == nil {
			continue
		}
		var dirs []string
		if i == 0 {
			dirs = []string{"/tmp", "/home/nonroot"}
		}
		data, err := Layer(files, s.Epoch, dirs...)
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", s.Name, err)
		}
		l, err := ociLayer(data)
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", s.Name, err)
		}
		if img, err = mutate.Append(img, mutate.Addendum{Layer: l, MediaType: types.OCILayer,
			History: v1.History{Created: v1.Time{Time: s.Epoch}, CreatedBy: "gpuplane deploy/cmd/images"}}); err != nil {
			return nil, fmt.Errorf("image %s: %w", s.Name, err)
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = "amd64", "linux"
	cf.Created = v1.Time{Time: s.Epoch}
	cf.Config = v1.Config{
		User:       fmt.Sprintf("%d:%d", NonRoot, NonRoot),
		Entrypoint: slices.Clone(s.Entrypoint),
		WorkingDir: "/home/nonroot",
		Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt", "HOME=/home/nonroot"},
		Labels:     s.Labels,
	}
	return mutate.ConfigFile(img, cf)
}

// WriteLayout writes img as a fresh OCI image layout in dir (replacing
// what was there) and returns its manifest digest.
func WriteLayout(dir, name string, img v1.Image) (v1.Hash, error) {
	if err := os.RemoveAll(dir); err != nil {
		return v1.Hash{}, err
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return v1.Hash{}, err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("layout %s: %w", dir, err)
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": name,
	}), layout.WithPlatform(v1.Platform{OS: "linux", Architecture: "amd64"})); err != nil {
		return v1.Hash{}, fmt.Errorf("layout %s: %w", dir, err)
	}
	return img.Digest()
}
