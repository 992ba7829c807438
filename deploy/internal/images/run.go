package images

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
)

// Unpack writes img's flattened file system into dir, with the owners and
// modes of its tar entries (owners need root).
func Unpack(img v1.Image, dir string) error {
	if err := os.Chmod(dir, 0o755); err != nil {
		return err
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(p, filepath.Clean(dir)+string(filepath.Separator)) {
			return fmt.Errorf("unpack: entry %q leaves the folder", h.Name)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return err
			}
			f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if err := errors.Join(err, f.Close()); err != nil {
				return err
			}
		default:
			continue
		}
		if err := os.Chown(p, h.Uid, h.Gid); err != nil {
			return err
		}
		mode := os.FileMode(h.Mode) & os.ModePerm
		if h.Mode&0o1000 != 0 {
			mode |= os.ModeSticky // /tmp is 1777
		}
		if err := os.Chmod(p, mode); err != nil {
			return err
		}
	}
}

// Run runs img's entrypoint with args the way a container runtime would
// start it, short of namespaces: chrooted into root (img unpacked there by
// Unpack), as the image's user, in its working directory, with its
// environment. It needs root.
func Run(ctx context.Context, img v1.Image, root string, args ...string) (string, error) {
	cf, err := img.ConfigFile()
	if err != nil {
		return "", err
	}
	uid, gid, err := parseUser(cf.Config.User)
	if err != nil {
		return "", err
	}
	if len(cf.Config.Entrypoint) == 0 {
		return "", errors.New("image has no entrypoint")
	}
	cmd := exec.CommandContext(ctx, cf.Config.Entrypoint[0], append(cf.Config.Entrypoint[1:], args...)...)
	cmd.Path = cf.Config.Entrypoint[0] // resolved inside the chroot
	cmd.Dir = cf.Config.WorkingDir
	cmd.Env = cf.Config.Env
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root, Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// parseUser reads a numeric, non-root "uid:gid".
func parseUser(user string) (uint32, uint32, error) {
	u, g, ok := strings.Cut(user, ":")
	uid, err1 := strconv.ParseUint(u, 10, 32)
	gid, err2 := strconv.ParseUint(g, 10, 32)
	if !ok || err1 != nil || err2 != nil || uid == 0 {
		return 0, 0, fmt.Errorf("image user %q: want a numeric non-root uid:gid", user)
	}
	return uint32(uid), uint32(gid), nil
}
