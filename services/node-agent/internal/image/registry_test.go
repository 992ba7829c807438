package image_test

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/compression"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// testRegistry is go-containerregistry's in-process registry on
// 127.0.0.1, behind a handler that counts what clients ask of it and
// can demand basic auth, fail manifests or stall a blob.
type testRegistry struct {
	srv  *httptest.Server
	host string

	mu       sync.Mutex
	requests map[string]int // "HEAD manifest", "GET manifest", "GET blob", "GET blob <digest>"
	users    map[string]string
	failWith string // a registry error body for every manifest request

	// stall, when set, holds a blob's download halfway until the client
	// goes away; corrupt flips a byte in the middle of a blob.
	stall, corrupt string
}

func startRegistry(t testing.TB) *testRegistry {
	t.Helper()
	r := &testRegistry{requests: map[string]int{}}
	inner := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		users, failWith, stall, corrupt := r.users, r.failWith, r.stall, r.corrupt
		r.mu.Unlock()
		if users != nil {
			if u, p, ok := req.BasicAuth(); !ok || p == "" || users[u] != p {
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				io.WriteString(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`)
				return
			}
		}
		kind := ""
		switch {
		case strings.Contains(req.URL.Path, "/manifests/"):
			kind = "manifest"
		case strings.Contains(req.URL.Path, "/blobs/") && !strings.Contains(req.URL.Path, "/uploads/"):
			kind = "blob"
		}
		if kind != "" && (req.Method == http.MethodGet || req.Method == http.MethodHead) {
			r.mu.Lock()
			r.requests[req.Method+" "+kind]++
			if kind == "blob" {
				r.requests[req.Method+" blob "+req.URL.Path[strings.LastIndex(req.URL.Path, "/")+1:]]++
			}
			r.mu.Unlock()
		}
		if kind == "manifest" && failWith != "" && req.Method != http.MethodPut {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, `{"errors":[{"code":"UNKNOWN","message":"`+failWith+`"}]}`)
			return
		}
		if kind == "blob" && req.Method == http.MethodGet && corrupt != "" && strings.HasSuffix(req.URL.Path, corrupt) {
			rec := httptest.NewRecorder()
			inner.ServeHTTP(rec, req)
			body := rec.Body.Bytes()
			body[len(body)/2] ^= 0xff
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			w.Write(body)
			return
		}
		if kind == "blob" && req.Method == http.MethodGet && stall != "" && strings.HasSuffix(req.URL.Path, stall) {
			rec := httptest.NewRecorder()
			inner.ServeHTTP(rec, req)
			body := rec.Body.Bytes()
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			w.Write(body[:len(body)/2])
			w.(http.Flusher).Flush()
			<-req.Context().Done()
			return
		}
		inner.ServeHTTP(w, req)
	}))
	t.Cleanup(r.srv.Close)
	r.host = strings.TrimPrefix(r.srv.URL, "http://")
	return r
}

func (r *testRegistry) count(key string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests[key]
}

func (r *testRegistry) reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests = map[string]int{}
}

func (r *testRegistry) total() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for k, v := range r.requests {
		if strings.Count(k, " ") == 1 {
			n += v
		}
	}
	return n
}

// requireAuth makes every request need one of users' passwords.
func (r *testRegistry) requireAuth(users map[string]string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.users = users
}

// push uploads img as repo:tag and returns its digest reference.
func (r *testRegistry) push(t testing.TB, repoTag string, img v1.Image, auth image.Auth) string {
	t.Helper()
	ref, err := name.ParseReference(r.host + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	a := authn.Anonymous
	if auth.Username != "" {
		a = authn.FromConfig(authn.AuthConfig{Username: auth.Username, Password: auth.Password})
	}
	if err := remote.Write(ref, img, remote.WithAuth(a)); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return ref.Context().Digest(d.String()).String()
}

// tarEntry is one entry of a test layer.
type tarEntry struct {
	name     string
	typ      byte
	mode     int64
	body     []byte
	linkname string
	uid, gid int
}

// layerOf is an uncompressed layer: quick to build and unpack under -race.
func layerOf(t testing.TB, entries ...tarEntry) v1.Layer {
	t.Helper()
	return layerAs(t, "none", entries...)
}

// layerAs is a layer compressed with comp: none, gzip or zstd.
func layerAs(t testing.TB, comp string, entries ...tarEntry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Size: int64(len(e.body)),
			Linkname: e.linkname, Uid: e.uid, Gid: e.gid, ModTime: time.Unix(1700000000, 0)}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			if _, err := tw.Write(e.body); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	var opts []tarball.LayerOption
	switch comp {
	case "none":
		return static.NewLayer(b, types.OCIUncompressedLayer)
	case "zstd":
		opts = append(opts, tarball.WithCompression(compression.ZStd), tarball.WithMediaType(types.OCILayerZStd))
	}
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func dir(n string) tarEntry { return tarEntry{name: n, typ: tar.TypeDir, mode: 0o755} }
func file(n, body string) tarEntry {
	return tarEntry{name: n, typ: tar.TypeReg, mode: 0o644, body: []byte(body)}
}
func symlink(n, target string) tarEntry {
	return tarEntry{name: n, typ: tar.TypeSymlink, linkname: target}
}

// busyboxImage is an image built from Debian's busybox-static: a base
// layer with /bin/busybox and its links, a layer of data, and a layer
// that deletes some of it with whiteouts (one plain, one opaque), plus a
// last layer with id, so that images of different ids differ.
//
// Images are built once per id and test binary: compressing and hashing
// busybox is most of this package's test time under -race.
func busyboxImage(t testing.TB, id string) v1.Image {
	t.Helper()
	return busyboxImageAs(t, id, "none")
}

// busyboxImageAs is busyboxImage with layers compressed with comp.
func busyboxImageAs(t testing.TB, id, comp string) v1.Image {
	t.Helper()
	if img, ok := builtImages.Load(id + "/" + comp); ok {
		return img.(v1.Image)
	}
	img := buildBusyboxImage(t, id, comp)
	builtImages.Store(id+"/"+comp, img)
	return img
}

var builtImages sync.Map // id/compression → v1.Image

func buildBusyboxImage(t testing.TB, id, comp string) v1.Image {
	t.Helper()
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Skipf("no /bin/busybox to build test images from (apt-get install busybox-static): %v", err)
	}
	base := layerAs(t, comp,
		dir("bin/"), dir("etc/"), dir("tmp/"),
		tarEntry{name: "bin/busybox", typ: tar.TypeReg, mode: 0o755, body: bb},
		symlink("bin/sh", "busybox"), symlink("bin/ls", "/bin/busybox"),
		file("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"),
	)
	data := layerAs(t, comp,
		dir("etc/"), file("etc/removed", "gone soon\n"), file("etc/kept", "still here\n"),
		dir("data/"), dir("data/old/"), file("data/old/a", "a\n"), dir("data/old/sub/"), file("data/old/sub/b", "b\n"),
		tarEntry{name: "data/owned", typ: tar.TypeReg, mode: 0o4750, body: []byte("setuid\n"), uid: 1000, gid: 1001},
		tarEntry{name: "bin/hardlinked", typ: tar.TypeLink, linkname: "bin/busybox"},
	)
	whiteouts := layerAs(t, comp,
		file("etc/.wh.removed", ""),
		file("data/old/new", "new\n"),
		file("data/old/.wh..wh..opq", ""),
	)
	last := layerAs(t, comp, file("id", id+"\n"))
	img, err := mutate.AppendLayers(empty.Image, base, data, whiteouts, last)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config = v1.Config{
		Entrypoint: []string{"/bin/sh", "-c"}, Cmd: []string{"echo hello from " + id},
		Env: []string{"PATH=/bin", "IMAGE_ID=" + id}, User: "65534:65534", WorkingDir: "/tmp",
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// eventually waits up to 10 s for cond.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within 10 s: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func acquire(t testing.TB, c *image.Cache, ref string, auth image.Auth) (image.Image, func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	img, release, err := c.Acquire(ctx, ref, auth, nil)
	if err != nil {
		t.Fatalf("acquire %s: %v", ref, err)
	}
	return img, release
}
