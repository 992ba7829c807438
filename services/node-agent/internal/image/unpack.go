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
			if err := a.retryResolved(victim, a.root.RemoveAll); err != nil {
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
		placed, err := a.entry(p, hdr, tr)
		if err != nil {
			return fmt.Errorf("layer entry %s: %w", p, err)
		}
		for q := placed; q != "."; q = path.Dir(q) {
			written[q] = true
		}
	}
	for _, hdr := range links {
		p, _ := clean(hdr.Name)
		target, ok := clean(hdr.Linkname)
		if !ok {
			return fmt.Errorf("hard link %s to %q leaves the root file system", p, hdr.Linkname)
		}
		p, err := a.place(p)
		if err != nil {
			return err
		}
		if err := a.replace(p); err != nil {
			return err
		}
		if err := a.retryResolved(target, func(t string) error { return a.root.Link(t, p) }); err != nil {
			return fmt.Errorf("hard link %s: %w", p, err)
		}
	}
	for _, dir := range opaque {
		dir, err := a.resolve(dir)
		if err != nil {
			return fmt.Errorf("opaque whiteout %s: %w", dir, err)
		}
		if err := a.hideBelow(dir, written); err != nil {
			return fmt.Errorf("opaque whiteout %s: %w", dir, err)
		}
	}
	return nil
}

// entry puts one non-link entry in place, replacing what the layers below
// had there, and returns where it went (see place).
func (a *applier) entry(p string, hdr *tar.Header, r io.Reader) (string, error) {
	p, err := a.place(p)
	if err != nil {
		return "", err
	}
	return p, a.put(p, hdr, r)
}

func (a *applier) put(p string, hdr *tar.Header, r io.Reader) error {
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

// place makes p's missing parent directories (layers need not list them,
// and a directory of a layer below may have been whited out) and returns
// the path of p itself. That is p, unless p goes through a symlink that
// os.Root will not follow: one to an absolute path (var/run → /run), or
// one that climbs above the root. A container resolves those against its
// root, as chroot does, and so does place: what a layer writes through
// them lands where the container will look, never outside the image.
func (a *applier) place(p string) (string, error) {
	dir := path.Dir(p)
	if dir == "." {
		return p, nil
	}
	err := a.root.MkdirAll(dir, 0o755)
	if err == nil {
		return p, nil
	}
	rdir, rerr := a.resolve(dir)
	if rerr != nil || rdir == dir {
		return "", fmt.Errorf("parents of %s: %w", p, err)
	}
	if err := a.root.MkdirAll(rdir, 0o755); err != nil {
		return "", fmt.Errorf("parents of %s (%s): %w", p, rdir, err)
	}
	return path.Join(rdir, path.Base(p)), nil
}

// retryResolved runs op on p and, where that fails for another reason
// than a missing file, once more with p's parent resolved as place does.
func (a *applier) retryResolved(p string, op func(string) error) error {
	err := op(p)
	if err == nil || errors.Is(err, fs.ErrNotExist) {
		return err
	}
	rdir, rerr := a.resolve(path.Dir(p))
	if rerr != nil || rdir == path.Dir(p) {
		return err
	}
	return op(path.Join(rdir, path.Base(p)))
}

// maxLinks bounds the symlinks resolve follows, as the kernel's ELOOP.
const maxLinks = 40

// resolve follows every symlink in p as a container will: absolute
// targets start again at the root, ".." stops at the root. Components
// that do not exist are kept as they are (place makes them).
func (a *applier) resolve(p string) (string, error) {
	var out []string
	rest := strings.Split(p, "/")
	links := 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
			continue
		}
		cur := path.Join(append(out, c)...)
		fi, err := a.root.Lstat(cur)
		if err != nil || fi.Mode()&fs.ModeSymlink == 0 {
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				return "", err
			}
			out = append(out, c)
			continue
		}
		if links++; links > maxLinks {
			return "", fmt.Errorf("%s: too many levels of symbolic links", p)
		}
		target, err := a.root.Readlink(cur)
		if err != nil {
			return "", err
		}
		if strings.HasPrefix(target, "/") {
			out = out[:0]
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	if len(out) == 0 {
		return ".", nil
	}
	return path.Join(out...), nil
}

// replace removes whatever the layers below left at p (a file, a link, a
// whole directory tree), as a later layer's entry replaces it.
func (a *applier) replace(p string) error {
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
