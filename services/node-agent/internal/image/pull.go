package image

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"golang.org/x/sys/unix"
)

// pull is one download and unpack of an image, shared by every Acquire
// that needs the same resolved digest meanwhile: one machine pulls an
// image once, however many runs start with it at the same time.
type pull struct {
	key    string // the resolved digest
	done   chan struct{}
	cancel context.CancelFunc // when no waiter is left

	// Guarded by Cache.mu.
	waiters   map[*waiter]bool // those still waiting
	records   []*waiter        // every waiter that joined, for the index
	completed bool

	// Only the pull's goroutine touches these.
	reported    int64
	reportedAny bool
}

// waiter is one Acquire waiting for a pull. The pull fills img, release
// and err under Cache.mu before it closes done.
type waiter struct {
	names    []string
	fp       string
	progress func(done, total int64)

	img     Image
	release func()
	err     error
}

// runPull fetches the image, records it, holds it once for every waiter
// still there (so no eviction can come between the unpack and the runs
// that asked for it) and runs the garbage collection its size may need.
func (c *Cache) runPull(ctx context.Context, p *pull, ref name.Digest, auth Auth) {
	defer c.bg.Done()
	defer p.cancel()
	start := c.cfg.Now()
	m, pinned, err := c.fetch(ctx, ref, auth, p)
	if err != nil {
		err = classify(ref.String(), err)
	}

	c.mu.Lock()
	if c.pulls[p.key] == p {
		delete(c.pulls, p.key)
	}
	p.completed = true
	if err == nil {
		c.meta[m.Digest] = m
		c.idx.LastUsed[m.Digest] = c.cfg.Now()
		for _, w := range p.records {
			c.recordLocked(w.names, p.key, m.Digest, w.fp)
		}
	}
	for w := range p.waiters {
		if err != nil {
			w.err = err
			continue
		}
		w.img, w.release, w.err = c.holdLocked(m.Digest)
	}
	if pinned {
		c.unpinLocked(m.Digest)
	}
	var victims []string
	if err == nil {
		victims = c.evictLocked()
		c.saveIndexOrLogLocked()
	}
	c.mu.Unlock()
	if err != nil {
		c.log.Warn("image pull failed", "image", ref.String(), "err", err)
	} else {
		c.log.Info("image pulled", "image", ref.String(), "digest", m.Digest,
			"download_bytes", m.Download, "bytes", m.Size, "took", c.cfg.Now().Sub(start))
	}
	if err == nil {
		c.changed() // before the waiters go on: what they see next includes it
	}
	close(p.done)
	// The waiters need not wait for the deletion of what was evicted.
	c.discard(victims)
}

// unpinLocked drops fetch's pin. Lock should be held.
func (c *Cache) unpinLocked(d string) {
	if c.holds[d]--; c.holds[d] <= 0 {
		delete(c.holds, d)
	}
}

// report passes progress to the waiters at the pull's start and end and
// about every tenth of it in between (no more often than every MiB): each
// call may become a pulling fact on the bus (contracts.RunPulling).
func (c *Cache) report(p *pull, done, total int64) {
	if p.reportedAny && done == p.reported {
		// Nothing new: the end is reported by the last layer's read and
		// again once every layer is in; a waiter must see it once.
		return
	}
	if done != 0 && done != total && done-p.reported < max(total/10, 1<<20) {
		return
	}
	p.reported, p.reportedAny = done, true
	c.mu.Lock()
	var fns []func(int64, int64)
	for w := range p.waiters {
		if w.progress != nil {
			fns = append(fns, w.progress)
		}
	}
	c.mu.Unlock()
	for _, f := range fns {
		f(done, total)
	}
}

// fetch downloads the image ref names for Platform and unpacks it into
// images/, or finds it there (an index seen for the first time may point
// at an image already cached): then it is pinned (held without a lease)
// so that no eviction takes it before runPull holds it for the waiters.
func (c *Cache) fetch(ctx context.Context, ref name.Digest, auth Auth, p *pull) (_ meta, pinned bool, _ error) {
	desc, err := remote.Get(ref, c.options(ctx, auth)...)
	if err != nil {
		return meta{}, false, err
	}
	img, err := desc.Image()
	if err != nil {
		if strings.Contains(err.Error(), "no child with platform") {
			return meta{}, false, fmt.Errorf("%w: %s: no %s/%s image in the index", ErrNotFound, ref, Platform.OS, Platform.Architecture)
		}
		return meta{}, false, err
	}
	d, err := img.Digest()
	if err != nil {
		return meta{}, false, err
	}
	digest := d.String()
	c.mu.Lock()
	m, cached := c.meta[digest]
	if cached {
		c.holds[digest]++
	}
	c.mu.Unlock()
	if cached {
		return m, true, nil
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return meta{}, false, err
	}
	if (cf.OS != "" && cf.OS != Platform.OS) || (cf.Architecture != "" && cf.Architecture != Platform.Architecture) {
		return meta{}, false, fmt.Errorf("%w: %s is a %s/%s image; this machine runs %s/%s",
			ErrNotFound, ref, cf.OS, cf.Architecture, Platform.OS, Platform.Architecture)
	}
	layers, err := img.Layers()
	if err != nil {
		return meta{}, false, err
	}
	var total int64
	for _, l := range layers {
		n, err := l.Size()
		if err != nil {
			return meta{}, false, err
		}
		total += n
	}

	tmp, err := os.MkdirTemp(c.tmp, d.Hex+".")
	if err != nil {
		return meta{}, false, err
	}
	defer os.RemoveAll(tmp) // a no-op once renamed into place
	rootfs := filepath.Join(tmp, "rootfs")
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return meta{}, false, err
	}
	var done int64
	c.report(p, 0, total)
	for i, l := range layers {
		err := c.unpack(ctx, rootfs, l, func(n int64) {
			done += n
			c.report(p, done, total)
		})
		if err != nil {
			return meta{}, false, fmt.Errorf("layer %d of %d: %w", i+1, len(layers), err)
		}
	}
	c.report(p, total, total)
	size, err := diskUsage(rootfs)
	if err != nil {
		return meta{}, false, err
	}
	m = meta{
		Digest: digest, Entrypoint: cf.Config.Entrypoint, Cmd: cf.Config.Cmd, Env: cf.Config.Env,
		User: cf.Config.User, WorkingDir: cf.Config.WorkingDir, Size: size, Download: total, Pulled: c.cfg.Now().UTC(),
		Boot: c.boot,
	}
	b, err := json.Marshal(m)
	if err != nil {
		return meta{}, false, err
	}
	if err := os.WriteFile(filepath.Join(tmp, "image.json"), b, 0o600); err != nil {
		return meta{}, false, err
	}
	// One rename makes the whole image visible: a process that dies
	// before it leaves only tmp/, which the next start empties.
	if err := os.Rename(tmp, c.imageDir(digest)); err != nil {
		return meta{}, false, fmt.Errorf("image into place: %w", err)
	}
	c.syncLater(c.imageDir(digest))
	return m, false, nil
}

// syncedMarker, in an image's directory, says that the image is on disk.
const syncedMarker = "synced"

// syncLater writes an image to disk in the background, then marks it
// (syncedMarker). The pull does not wait: syncfs writes everything dirty
// on the file system, a busy machine's logs and checkpoints too, and an
// image in the page cache is whole for every process until the machine
// goes down. What a power loss can leave half written is an image that
// was never marked: New drops those of an earlier boot.
func (c *Cache) syncLater(dir string) {
	c.bg.Add(1)
	go func() {
		defer c.bg.Done()
		f, err := os.Open(dir)
		if err != nil {
			return // evicted already
		}
		err = unix.Syncfs(int(f.Fd()))
		f.Close()
		if err == nil {
			// Written after the sync returned: never on disk before the image.
			err = os.WriteFile(filepath.Join(dir, syncedMarker), nil, 0o600)
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			c.log.Warn("image cache: image not synced to disk (a reboot before the next sync drops it)", "dir", dir, "err", err)
		}
	}()
}

// unpack downloads one layer and applies it to rootfs, calling downloaded
// with the compressed bytes as they arrive.
func (c *Cache) unpack(ctx context.Context, rootfs string, l v1.Layer, downloaded func(n int64)) error {
	rc, err := l.Compressed()
	if err != nil {
		return err
	}
	defer rc.Close()
	cr := &countingReader{ctx: ctx, r: rc, add: downloaded}
	r, closeZ, err := decompress(cr)
	if err != nil {
		return fmt.Errorf("decompress: %w", err)
	}
	defer closeZ()
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return err
	}
	defer root.Close()
	a := &applier{root: root, asRoot: os.Geteuid() == 0}
	if err := a.apply(tar.NewReader(r)); err != nil {
		return err
	}
	// Read the blob to its end: go-containerregistry checks its digest at
	// EOF, and a blob that does not match fails the pull here.
	if _, err := io.Copy(io.Discard, cr); err != nil {
		return err
	}
	return nil
}

// countingReader counts what is read and stops when ctx ends.
type countingReader struct {
	ctx context.Context
	r   io.Reader
	add func(n int64)
}

func (c *countingReader) Read(b []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	n, err := c.r.Read(b)
	if n > 0 {
		c.add(int64(n))
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return n, fmt.Errorf("download: %w", err)
	}
	return n, err
}
