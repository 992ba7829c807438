package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/klauspost/compress/zstd"
)

// The OCI whiteout names (image-spec layer.md): ".wh.NAME" deletes NAME
// of the layers below; ".wh..wh..opq" in a directory hides everything the
// layers below put in it.
const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
)

var (
	gzipMagic = []byte{0x1f, 0x8b}
	zstdMagic = []byte{0x28, 0xb5, 0x2f, 0xfd}
)

// decompress reads a layer blob as the registry sent it: gzip, zstd or a
// plain tar, told apart by their magic numbers rather than the media type
// (registries and build tools disagree on media types, never on bytes).
func decompress(r io.Reader) (io.Reader, func(), error) {
	br := bufio.NewReaderSize(r, 64<<10)
	head, err := br.Peek(4)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, err
	}
	switch {
	case bytes.HasPrefix(head, gzipMagic):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, err
		}
		return zr, func() { zr.Close() }, nil
	case bytes.HasPrefix(head, zstdMagic):
		zr, err := zstd.NewReader(br)
		if err != nil {
			return nil, nil, err
		}
		return zr, zr.Close, nil
	}
	return br, func() {}, nil
}

// applier applies layers, bottom first, to one root file system. All file
// operations go through an os.Root, so an entry or a symlink of a hostile
// image that points outside the root ("../../etc/passwd", a link to /)
// fails instead of writing on the host.
type applier struct {
	root    *os.Root
	asRoot  bool // chown as the image says (the agent runs as root)
	skipped int  // device nodes and FIFOs: runc makes /dev
}

// apply unpacks one layer's tar stream.
func (a *applier) apply(tr *tar.Reader) error {
	// written is every path this layer put in place, with its parents, for
	// the opaque whiteouts, which apply to the layers below only and may
	// come before or after the entries of their directory.
	written := map[string]bool{}
	var opaque []string
	var links []*tar.Header // hard links, once their targets are in place
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("read layer: %w", err)
		}
		p, ok := clean(hdr.Name)
		if !ok {
			return fmt.Errorf("layer entry %q leaves the root file system", hdr.Name)
		}
		if p == "." {
			continue // the root itself: its mode is the runtime's business
		}
		dir, base := path.Split(p)
		dir = strings.TrimSuffix(dir, "/")
		if dir == "" {
			dir = "."
		}
		switch {
		case base == whiteoutOpaque:
			opaque = append(opaque, dir)
			continue
		case strings.HasPrefix(base, whiteoutPrefix):
			victim := path.Join(dir, strings.TrimPrefix(base, whiteoutPrefix))
			if err := a.root.RemoveAll(victim); err != nil {
				return fmt.Errorf("whiteout %s: %w", victim, err)
			}
			continue
		}
		for q := p; q != "."; q = path.Dir(q) {
			written[q] = true
		}
		if hdr.Typeflag == tar.TypeLink {
			links = append(links, hdr)
			continue
		}
		if err := a.entry(p, hdr, tr); err != nil {
			return fmt.Errorf("layer entry %s: %w", p, err)
		}
	}
	for _, hdr := range links {
		p, _ := clean(hdr.Name)
		target, ok := clean(hdr.Linkname)
		if !ok {
			return fmt.Errorf("hard link %s to %q leaves the root file system", p, hdr.Linkname)
		}
		if err := a.replace(p); err != nil {
			return err
		}
		if err := a.root.Link(target, p); err != nil {
			return fmt.Errorf("hard link %s: %w", p, err)
		}
	}
	for _, dir := range opaque {
		if err := a.hideBelow(dir, written); err != nil {
			return fmt.Errorf("opaque whiteout %s: %w", dir, err)
		}
	}
	return nil
}

// entry puts one non-link entry in place, replacing what the layers below
// had there.
func (a *applier) entry(p string, hdr *tar.Header, r io.Reader) error {
	mode := fs.FileMode(hdr.Mode).Perm()
	if hdr.Mode&04000 != 0 {
		mode |= fs.ModeSetuid
	}
	if hdr.Mode&02000 != 0 {
		mode |= fs.ModeSetgid
	}
	if hdr.Mode&01000 != 0 {
		mode |= fs.ModeSticky
	}
	if err := a.parents(p); err != nil {
		return err
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		if fi, err := a.root.Lstat(p); err == nil && !fi.IsDir() {
			if err := a.root.Remove(p); err != nil {
				return err
			}
		}
		if err := a.root.Mkdir(p, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	case tar.TypeReg, tar.TypeRegA:
		if err := a.replace(p); err != nil {
			return err
		}
		f, err := a.root.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, r)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case tar.TypeSymlink:
		if err := a.replace(p); err != nil {
			return err
		}
		if err := a.root.Symlink(hdr.Linkname, p); err != nil {
			return err
		}
		return a.chown(p, hdr) // a symlink's mode means nothing on Linux
	default: // char and block devices, FIFOs
		a.skipped++
		return nil
	}
	// Owner first: chown clears the setuid and setgid bits.
	if err := a.chown(p, hdr); err != nil {
		return err
	}
	if err := a.root.Chmod(p, mode); err != nil {
		return err
	}
	if hdr.Typeflag != tar.TypeDir {
		// A directory's time changes with each later entry in it.
		return a.root.Chtimes(p, hdr.ModTime, hdr.ModTime)
	}
	return nil
}

func (a *applier) chown(p string, hdr *tar.Header) error {
	if !a.asRoot {
		return nil
	}
	return a.root.Lchown(p, hdr.Uid, hdr.Gid)
}

// parents makes p's missing parent directories: layers need not list
// them, and a directory of a layer below may have been whited out.
func (a *applier) parents(p string) error {
	dir := path.Dir(p)
	if dir == "." {
		return nil
	}
	if err := a.root.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("parents of %s: %w", p, err)
	}
	return nil
}

// replace removes whatever the layers below left at p (a file, a link, a
// whole directory tree), as a later layer's entry replaces it.
func (a *applier) replace(p string) error {
	if err := a.parents(p); err != nil {
		return err
	}
	if _, err := a.root.Lstat(p); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return a.root.RemoveAll(p)
}

// hideBelow removes from dir what the layers below put there: every path
// under it that this layer neither wrote nor needs as a parent.
func (a *applier) hideBelow(dir string, written map[string]bool) error {
	f, err := a.root.Open(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	for _, n := range names {
		p := path.Join(dir, n)
		if !written[p] {
			if err := a.root.RemoveAll(p); err != nil {
				return err
			}
			continue
		}
		if fi, err := a.root.Lstat(p); err == nil && fi.IsDir() {
			if err := a.hideBelow(p, written); err != nil {
				return err
			}
		}
	}
	return nil
}

// clean turns a tar entry name into a path relative to the root ("." for
// the root), and says false for one that climbs out of it: such an entry
// is hostile or broken, and the pull fails rather than guess.
func clean(name string) (string, bool) {
	p := path.Clean(strings.TrimLeft(name, "/"))
	if p == ".." || strings.HasPrefix(p, "../") {
		return "", false
	}
	return p, true
}

// diskUsage is the bytes a tree takes on disk, each inode once.
func diskUsage(dir string) (int64, error) {
	seen := map[uint64]bool{}
	var total int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			if seen[st.Ino] {
				return nil
			}
			seen[st.Ino] = true
			total += st.Blocks * 512
			return nil
		}
		total += fi.Size()
		return nil
	})
	return total, err
}
