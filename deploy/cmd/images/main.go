// Command images builds gpuplane's OCI images with no container daemon
// (`make images`): each service's binary (static, except the node agent's
// cgo build for go-nvml), the exec probe, and a distroless-style base made
// from this machine's files, written as OCI image layouts under -out, one
// folder per service. It then writes the kustomize component that pins the
// Kubernetes manifests to these images by digest.
//
//	go run ./cmd/images -root .. -rev HEAD
//
// (-rev builds a commit's sources, not the working tree: the digests written
// then belong to that commit, whatever else is being edited.)
//
// Push a layout with its digest kept, e.g.
// `skopeo copy --preserve-digests oci:build/images/scheduler docker://REGISTRY/gpuplane/scheduler`.
package main

import (
	"archive/tar"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/gpuplane/gpuplane/deploy/internal/images"
)

// Service is one image: the binary and where it comes from.
type Service struct {
	Name string
	// Build compiles the binary; ignored when Host is set.
	Build images.GoBuild
	// Host is a binary of this machine's (Debian's redis-server), taken
	// with the shared libraries it links; the image is then as
	// reproducible as that package's version.
	Host string
	// Smoke are arguments with which the entrypoint exits 0 at once (its
	// help or version): run from the image as the image's user, they
	// prove the image starts (see smoke).
	Smoke []string
}

// Services are the images `make images` builds, one per workload of
// deploy/kubernetes (TestManifests checks the manifests use exactly these).
func Services(root string) []Service {
	svc := func(name string, cgo bool) Service {
		return Service{Name: name, Build: images.GoBuild{
			ModuleDir: filepath.Join(root, "services", name), Package: "./cmd/" + name, Cgo: cgo}, Smoke: []string{"-h"}}
	}
	return []Service{
		svc("scheduler", false),
		svc("resource-manager", false),
		svc("monitor", false),
		svc("autoscaler", false),
		svc("billing", false),
		svc("gateway", false),
		svc("node-agent", true),
		// The dev overlay's simulated fleet (the node agent's code, many
		// machines on one connection), for clusters without GPUs.
		{Name: "fleet-sim", Build: images.GoBuild{ModuleDir: filepath.Join(root, "services", "node-agent"), Package: "./cmd/fleet-sim", Cgo: true},
			Smoke: []string{"-h"}},
		// NATS from the module version every other part pins.
		{Name: "nats-server", Build: images.GoBuild{ModuleDir: filepath.Join(root, "deploy"), Package: "github.com/nats-io/nats-server/v2"},
			Smoke: []string{"--version"}},
		{Name: "redis", Host: "/usr/bin/redis-server", Smoke: []string{"--version"}},
	}
}

// ImagePrefix names every image: gpuplane/<service>.
const ImagePrefix = "gpuplane/"

func main() {
	root := flag.String("root", "..", "repository root")
	out := flag.String("out", "", "folder of the OCI layouts (default <root>/build/images)")
	component := flag.String("component", "", "kustomize component to write the digests into (default <root>/deploy/kubernetes/images/kustomization.yaml); \"-\" for none")
	only := flag.String("only", "", "comma-separated services to build (default all); the component then keeps the others' digests")
	ca := flag.String("ca", "/etc/ssl/certs/ca-certificates.crt", "CA bundle copied into the base")
	rev := flag.String("rev", "", "build the sources of this git revision (git archive), not the working tree: the digests then belong to a commit, whatever is being edited")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if *out == "" {
		*out = filepath.Join(*root, "build", "images")
	}
	if *component == "" {
		*component = filepath.Join(*root, "deploy", "kubernetes", "images", "kustomization.yaml")
	}
	if err := build(ctx, log, *root, *rev, *out, *component, *only, *ca); err != nil {
		log.Error("images", "err", err)
		stop()
		os.Exit(1)
	}
}

// build runs the build on the working tree, or on revision rev exported
// into a temporary folder (removed after).
func build(ctx context.Context, log *slog.Logger, root, rev, out, component, only, ca string) error {
	if rev == "" {
		return run(ctx, log, root, out, component, only, ca, "the working tree")
	}
	commit, err := exec.CommandContext(ctx, "git", "-C", root, "rev-parse", "--verify", rev+"^{commit}").Output()
	if err != nil {
		return fmt.Errorf("git rev-parse %s: %w", rev, err)
	}
	dir, err := os.MkdirTemp("", "gpuplane-src-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// The commit, not rev: HEAD may move while this runs.
	hash := strings.TrimSpace(string(commit))
	if err := exportRev(ctx, root, hash, dir); err != nil {
		return err
	}
	source := "commit " + hash
	log.Info("building a git revision", "source", source, "dir", dir)
	return run(ctx, log, dir, out, component, only, ca, source)
}

// exportRev writes the tree of git revision rev of the repository at root
// into dir (git archive), so a build reads exactly that commit's sources.
func exportRev(ctx context.Context, root, rev, dir string) error {
	cmd := exec.CommandContext(ctx, "git", "-C", root, "archive", "--format=tar", rev)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	tr := tar.NewReader(out)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			_ = cmd.Wait()
			return fmt.Errorf("git archive %s: %w: %s", rev, err, stderr.String())
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(p, filepath.Clean(dir)+string(filepath.Separator)) {
			return fmt.Errorf("git archive %s: entry %q leaves the folder", rev, h.Name)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, 0o755)
		case tar.TypeReg:
			err = writeFile(p, tr, os.FileMode(h.Mode)&0o777)
		case tar.TypeSymlink:
			err = os.Symlink(h.Linkname, p)
		}
		if err != nil {
			_ = cmd.Wait()
			return fmt.Errorf("git archive %s: %w", rev, err)
		}
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("git archive %s: %w: %s", rev, err, stderr.String())
	}
	return nil
}

func writeFile(path string, r io.Reader, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	return errors.Join(err, f.Close())
}

// Epoch is SOURCE_DATE_EPOCH, or the Unix epoch when unset.
func Epoch() (time.Time, error) {
	v := os.Getenv("SOURCE_DATE_EPOCH")
	if v == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	s, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", v, err)
	}
	return time.Unix(s, 0).UTC(), nil
}

func run(ctx context.Context, log *slog.Logger, root, out, component, only, ca, source string) error {
	epoch, err := Epoch()
	if err != nil {
		return err
	}
	base, err := images.BaseFiles(ca)
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "gpuplane-images-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	probe := filepath.Join(work, "gpuplane-probe")
	if err := ProbeBuild(root).Build(ctx, probe); err != nil {
		return err
	}
	probeData, err := os.ReadFile(probe)
	if err != nil {
		return err
	}
	digests := map[string]string{}
	if component != "-" {
		d, err := ReadComponent(component)
		switch {
		case err == nil:
			digests = d
		case !errors.Is(err, os.ErrNotExist):
			return err
		}
	}
	want := map[string]bool{}
	for s := range strings.SplitSeq(only, ",") {
		if s = strings.TrimSpace(s); s != "" {
			want[s] = true
		}
	}
	for _, s := range Services(root) {
		if len(want) > 0 && !want[s.Name] {
			continue
		}
		if s.Host != "" {
			if _, err := os.Stat(s.Host); err != nil {
				log.Warn("image skipped, its digest kept: install the package that has it", "name", ImagePrefix+s.Name, "err", err)
				continue
			}
		}
		start := time.Now()
		spec, err := ServiceSpec(ctx, s, work, base, probeData, epoch)
		if err != nil {
			return err
		}
		img, err := images.Image(spec)
		if err != nil {
			return err
		}
		d, err := images.WriteLayout(filepath.Join(out, s.Name), spec.Name, img)
		if err != nil {
			return err
		}
		if err := smoke(ctx, log, img, s.Smoke); err != nil {
			return fmt.Errorf("image %s does not start: %w", spec.Name, err)
		}
		digests[spec.Name] = d.String()
		log.Info("image", "name", spec.Name, "digest", d.String(), "layout", filepath.Join(out, s.Name), "took", time.Since(start).Round(time.Millisecond))
	}
	if component == "-" {
		return nil
	}
	return WriteComponent(component, digests, source)
}

// smoke runs the image's entrypoint with args from the unpacked image, as
// its user (images.Run), when this process is root; otherwise it says it
// did not.
func smoke(ctx context.Context, log *slog.Logger, img v1.Image, args []string) error {
	if len(args) == 0 {
		return nil
	}
	if os.Geteuid() != 0 {
		log.Warn("start check skipped: it needs root (chroot, another user)")
		return nil
	}
	dir, err := os.MkdirTemp("", "gpuplane-rootfs-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := images.Unpack(img, dir); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if out, err := images.Run(ctx, img, dir, args...); err != nil {
		return fmt.Errorf("%v: %w\n%s", args, err, out)
	}
	return nil
}

// ProbeBuild builds gpuplane-probe from this module.
func ProbeBuild(root string) images.GoBuild {
	return images.GoBuild{ModuleDir: filepath.Join(root, "deploy"), Package: "./cmd/gpuplane-probe"}
}

// ServiceSpec builds s's binary under work and describes its image.
func ServiceSpec(ctx context.Context, s Service, work string, base []images.File, probe []byte, epoch time.Time) (images.Spec, error) {
	bin := filepath.Join(work, s.Name)
	if s.Host != "" {
		bin = s.Host
	} else if err := s.Build.Build(ctx, bin); err != nil {
		return images.Spec{}, err
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return images.Spec{}, err
	}
	var extra []images.File
	if s.Build.Cgo || s.Host != "" {
		if extra, err = images.SharedLibs(ctx, bin); err != nil {
			return images.Spec{}, err
		}
	}
	path := "/usr/local/bin/" + s.Name
	return images.Spec{
		Name:  ImagePrefix + s.Name,
		Base:  base,
		Extra: extra,
		Binaries: []images.File{
			{Path: path, Data: data, Mode: 0o755},
			{Path: "/usr/local/bin/gpuplane-probe", Data: probe, Mode: 0o755},
		},
		Entrypoint: []string{path},
		Epoch:      epoch,
		Labels: map[string]string{
			"org.opencontainers.image.title":  ImagePrefix + s.Name,
			"org.opencontainers.image.source": "https://github.com/gpuplane/gpuplane",
		},
	}, nil
}

const componentHeader = `# Generated by ` + "`make images`" + ` (deploy/cmd/images): the digest of each image, built
# from the sources named below. Do not edit; the base's kustomization
# includes this component so every container refers to its image by digest.
`

const componentBody = `apiVersion: kustomize.config.k8s.io/v1alpha1
kind: Component
images:
`

// WriteComponent writes the kustomize component pinning each image name
// to its digest, sorted by name, saying which sources they were built from
// (a commit, or "the working tree").
func WriteComponent(path string, digests map[string]string, source string) error {
	names := make([]string, 0, len(digests))
	for n := range digests {
		names = append(names, n)
	}
	slices.Sort(names)
	var b strings.Builder
	b.WriteString(componentHeader)
	fmt.Fprintf(&b, "# Sources: %s (%s).\n", source, runtime.Version())
	b.WriteString(componentBody)
	for _, n := range names {
		fmt.Fprintf(&b, "- name: %s\n  digest: %s\n", n, digests[n])
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// ReadComponent reads back what WriteComponent wrote.
func ReadComponent(path string) (map[string]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	digests := map[string]string{}
	var name string
	for line := range strings.SplitSeq(string(data), "\n") {
		line = strings.TrimSpace(line)
		if v, ok := strings.CutPrefix(line, "- name: "); ok {
			name = v
		} else if v, ok := strings.CutPrefix(line, "digest: "); ok && name != "" {
			digests[name] = v
		}
	}
	return digests, nil
}
