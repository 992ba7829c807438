package oci

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// The layout of a bundle directory.
const (
	bundleConfig = "config.json"
	bundleRootfs = "rootfs" // the container's root: an overlay, or a read-only bind of the image
	bundleUpper  = "upper"  // the overlay's writable layer: what the run wrote, gone with the bundle
	bundleWork   = "work"   // overlayfs's own scratch
)

// tryOverlay is false in tests of the read-only fallback.
var tryOverlay = true

// Bundle is one run's OCI bundle.
type Bundle struct {
	Dir string
	// Overlay is set when the root is an overlay of the image (writable,
	// what the run writes is its own); otherwise the root is the image
	// itself, read-only, with a tmpfs /tmp.
	Overlay bool
	Spec    *specs.Spec
}

// CreateBundle lays out c's bundle in dir, which must not exist: its root
// an overlay of the image's shared read-only root with the run's own
// upper layer (we are root), or where overlayfs cannot be mounted (dir on
// a filesystem overlayfs refuses as upper) a read-only bind of the image
// root, so nothing the run does reaches the shared image. Then it writes
// config.json. On error nothing is left mounted.
func CreateBundle(dir string, c Config) (b Bundle, err error) {
	if c.Image.RootFS == "" {
		return Bundle{}, errors.New("the image has no root filesystem")
	}
	if fi, err := os.Stat(c.Image.RootFS); err != nil || !fi.IsDir() {
		return Bundle{}, fmt.Errorf("image root %s: not a directory (%v)", c.Image.RootFS, err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return Bundle{}, fmt.Errorf("bundle: %w", err)
	}
	defer func() {
		if err != nil {
			_ = RemoveBundle(dir)
		}
	}()
	rootfs := filepath.Join(dir, bundleRootfs)
	for _, d := range []string{rootfs, filepath.Join(dir, bundleUpper), filepath.Join(dir, bundleWork)} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return Bundle{}, fmt.Errorf("bundle: %w", err)
		}
	}
	b = Bundle{Dir: dir}
	var overlayErr error
	if tryOverlay {
		opts := "lowerdir=" + c.Image.RootFS + ",upperdir=" + filepath.Join(dir, bundleUpper) + ",workdir=" + filepath.Join(dir, bundleWork)
		overlayErr = syscall.Mount("overlay", rootfs, "overlay", 0, opts)
		b.Overlay = overlayErr == nil
	}
	if !b.Overlay {
		if err := syscall.Mount(c.Image.RootFS, rootfs, "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
			return Bundle{}, fmt.Errorf("mount the image root (overlay: %v): %w", overlayErr, err)
		}
		// A bind mount is read-only only once remounted so.
		if err := syscall.Mount("", rootfs, "", syscall.MS_BIND|syscall.MS_REMOUNT|syscall.MS_RDONLY|syscall.MS_REC, ""); err != nil {
			return Bundle{}, fmt.Errorf("make the image root read-only: %w", err)
		}
	}
	if !b.Overlay {
		// runc would make a missing mount point in the image itself: fail
		// here, saying why, instead.
		for _, m := range c.Mounts {
			if _, err := os.Stat(filepath.Join(rootfs, m.Target)); err != nil {
				return Bundle{}, fmt.Errorf("overlayfs is unavailable here (%v) and the image has no %s to mount %s on", overlayErr, m.Target, m.Source)
			}
		}
	}
	b.Spec, err = Spec(c, bundleRootfs, !b.Overlay)
	if err != nil {
		return Bundle{}, err
	}
	data, err := json.MarshalIndent(b.Spec, "", "\t")
	if err != nil {
		return Bundle{}, err
	}
	if err := os.WriteFile(filepath.Join(dir, bundleConfig), data, 0o600); err != nil {
		return Bundle{}, fmt.Errorf("bundle: %w", err)
	}
	return b, nil
}

// RemoveBundle unmounts a bundle's root and removes the bundle; a bundle
// that does not exist is removed already. Nothing is removed while the
// root stays mounted: removing through it would reach the image.
func RemoveBundle(dir string) error {
	rootfs := filepath.Join(dir, bundleRootfs)
	// Until nothing is mounted there (EINVAL: not a mount point): a
	// bundle whose creation raced a crash may hold two.
	for i := 0; ; i++ {
		err := syscall.Unmount(rootfs, syscall.MNT_DETACH)
		if errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOENT) {
			break
		}
		if err != nil || i == 8 {
			return fmt.Errorf("unmount %s: %v", rootfs, err)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove bundle: %w", err)
	}
	return nil
}
