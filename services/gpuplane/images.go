package gpuplane

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// LocalRegistryHost is the registry the all-in-one serves in-process to
// its own node agents: a newcomer without internet access still has an
// image to run (`gpuctl submit --image gpuplane.localhost/busybox`). The
// name is under .localhost (RFC 6761), which never reaches a real
// registry; nothing listens on a port for it, so two all-in-ones on one
// machine (tests) never collide.
const LocalRegistryHost = "gpuplane.localhost"

// BusyboxRef is the image the all-in-one builds at start from the
// machine's static busybox and serves from LocalRegistryHost.
const BusyboxRef = LocalRegistryHost + "/busybox:latest"

// FindBusybox is the path of a statically linked busybox (Debian's
// busybox-static): it runs in an image that holds nothing else.
func FindBusybox() (string, error) {
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		f, err := elf.Open(p)
		if err != nil {
			continue
		}
		static := !slices.ContainsFunc(f.Progs, func(p *elf.Prog) bool { return p.Type == elf.PT_INTERP })
		_ = f.Close()
		if static {
			return p, nil
		}
	}
	return "", errors.New("no statically linked busybox in /bin or /usr/bin (Debian: apt-get install busybox-static)")
}

// BusyboxImage builds a one-layer OCI image of this machine's platform
// from a static busybox: /bin/busybox with a link per applet, /etc/passwd
// and /etc/group (root, app 1000:1000, nobody), a world-writable /tmp and
// /work, and extra files (path -> content, mode 0644), which give tests
// images of different digests. Its config runs sh with PATH=/bin, as root
// (the node agent runs it as nobody unless the job names a user). The
// image is reproducible: the same busybox and extras give the same digest.
func BusyboxImage(busybox string, extra map[string]string) (v1.Image, error) {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	out, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		return nil, fmt.Errorf("busybox image: %s --list: %w", busybox, err)
	}
	applets := strings.Fields(string(out))

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	epoch := time.Unix(0, 0)
	add := func(h *tar.Header, data []byte) error {
		h.ModTime, h.Format = epoch, tar.FormatPAX
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	dirs := map[string]int64{"bin": 0o755, "etc": 0o755, "home": 0o755, "home/app": 0o755, "tmp": 0o1777, "work": 0o777,
		"proc": 0o755, "sys": 0o755, "dev": 0o755}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":  "root:x:0:\napp:x:1000:\nnogroup:x:65534:\n",
	}
	for p, content := range extra {
		p = strings.TrimPrefix(path.Clean("/"+p), "/")
		files[p] = content
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			if _, ok := dirs[d]; !ok {
				dirs[d] = 0o755
			}
		}
	}
	for _, d := range slicesSorted(dirs) {
		if err := add(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: dirs[d]}, nil); err != nil {
			return nil, fmt.Errorf("busybox image: %w", err)
		}
	}
	if err := add(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755}, bin); err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	for _, a := range applets {
		if a == "busybox" || strings.Contains(a, "/") {
			continue
		}
		if err := add(&tar.Header{Name: "bin/" + a, Typeflag: tar.TypeSymlink, Linkname: "busybox", Mode: 0o777}, nil); err != nil {
			return nil, fmt.Errorf("busybox image: %w", err)
		}
	}
	for _, f := range slicesSorted(files) {
		if err := add(&tar.Header{Name: f, Typeflag: tar.TypeReg, Mode: 0o644}, []byte(files[f])); err != nil {
			return nil, fmt.Errorf("busybox image: %w", err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	layerTar := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{Cmd: []string{"sh"}, Env: []string{"PATH=/bin"}, WorkingDir: "/"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	return img, nil
}

func slicesSorted[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// LocalRegistry is go-containerregistry's registry (pkg/registry, in
// memory) served without a socket to whoever uses its Transport: requests
// for LocalRegistryHost go to it, any other host to the next transport.
type LocalRegistry struct {
	handler http.Handler
}

// NewLocalRegistry is an empty registry.
func NewLocalRegistry() *LocalRegistry {
	return &LocalRegistry{handler: registry.New(registry.Logger(log.New(io.Discard, "", 0)))}
}

// Handler serves the registry's API (tests put it behind a listener).
func (r *LocalRegistry) Handler() http.Handler { return r.handler }

// Transport reaches LocalRegistryHost in this process and every other
// registry through next (nil: http.DefaultTransport).
func (r *LocalRegistry) Transport(next http.RoundTripper) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return localTransport{r: r, next: next}
}

// Push stores img under ref (a reference to LocalRegistryHost).
func (r *LocalRegistry) Push(ref string, img v1.Image) error {
	parsed, err := name.ParseReference(ref)
	if err != nil {
		return err
	}
	if h := parsed.Context().RegistryStr(); h != LocalRegistryHost {
		return fmt.Errorf("push %s: not a reference to %s", ref, LocalRegistryHost)
	}
	if err := remote.Write(parsed, img, remote.WithTransport(r.Transport(nil))); err != nil {
		return fmt.Errorf("push %s: %w", ref, err)
	}
	return nil
}

type localTransport struct {
	r    *LocalRegistry
	next http.RoundTripper
}

func (t localTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Hostname() != LocalRegistryHost {
		return t.next.RoundTrip(req)
	}
	// A round tripper must not change the request: the handler gets a
	// copy, whose body it reads to the end (an upload).
	in := req.Clone(req.Context())
	in.RequestURI = in.URL.RequestURI()
	if in.Body == nil {
		in.Body = http.NoBody // as a server's requests always have one
	}
	rec := httptest.NewRecorder()
	t.r.handler.ServeHTTP(rec, in)
	if req.Body != nil {
		_ = req.Body.Close()
	}
	resp := rec.Result()
	resp.Request = req
	return resp, nil
}

// builtinImages starts the built-in registry and serves BusyboxRef from
// it where this machine has a static busybox; the note says what
// container runs lack here (busybox, runc, root), "" when nothing.
func builtinImages(log *slog.Logger) (*LocalRegistry, []string, string) {
	r := NewLocalRegistry()
	var refs, missing []string
	if bb, err := FindBusybox(); err != nil {
		missing = append(missing, "no image: "+err.Error())
	} else if img, err := BusyboxImage(bb, nil); err != nil {
		missing = append(missing, "no image: "+err.Error())
	} else if err := r.Push(BusyboxRef, img); err != nil {
		missing = append(missing, "no image: "+err.Error())
	} else {
		refs = append(refs, BusyboxRef)
	}
	if _, err := findRunc(); err != nil {
		missing = append(missing, "container runs fail with runtime_unavailable: "+err.Error())
	} else if os.Geteuid() != 0 {
		missing = append(missing, "container runs fail: runc needs root")
	}
	note := strings.Join(missing, "; ")
	if note != "" {
		log.Warn("container runs are not possible here; host commands still run", "why", note)
	}
	return r, refs, note
}

// findRunc finds runc as the node agent does: PATH, then Debian's
// directories (a user's PATH often lacks /usr/sbin).
func findRunc() (string, error) {
	if p, err := exec.LookPath("runc"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/runc", "/usr/bin/runc", "/sbin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc"} {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", errors.New("no runc (Debian: apt-get install runc)")
}
