// Package image is the node agent's cache of container images: it pulls
// an OCI image for this machine's platform (linux/amd64) from its
// registry with the tenant's credentials, unpacks its layers once into a
// read-only root file system shared by every run of that image, and
// garbage-collects the least recently used images past a size limit,
// never one that a run holds.
//
//	Acquire(ref, auth) ──▶ cached and allowed? ──yes──▶ hold ──▶ Image{RootFS}, release
//	                        │ no
//	                        ▼
//	             resolve (HEAD) ──▶ digest cached? ──yes──▶ hold
//	                        │ no
//	                        ▼
//	   one pull per digest (waiters share it) ──▶ tmp/<hex>.*/rootfs ──rename──▶ images/<hex>
//
// On disk, under Config.Dir:
//
//	images/<digest hex>/rootfs      the unpacked image, shared and never written after the rename
//	images/<digest hex>/image.json  its config (entrypoint, cmd, env, user, working dir), size, boot
//	images/<digest hex>/synced      written once the image is on disk (synced in the background)
//	index.json                      references → digests, grants, last use (rewritten atomically)
//	leases/<id>                     one per hold, so a restarted agent keeps its runs' images
//	tmp/                            unpacks in progress and images being deleted; emptied at start
//
// An image appears in images/ by one rename of a complete directory, so an
// agent that crashes mid-unpack leaves only a tmp/ entry, which the next
// start deletes: a half image never looks whole. A machine that loses
// power may lose files the kernel had not written yet; an image of an
// earlier boot without its synced mark is dropped at start for that.
package image

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// Platform is the only platform the cache pulls: the agent runs GPU jobs
// on linux/amd64 machines.
var Platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// Config configures a Cache.
type Config struct {
	// Dir holds the cache (see the package comment); it is created.
	Dir string
	// MaxBytes bounds the disk the unpacked images take; past it, the least
	// recently used images that no run holds are deleted. 0 means no bound.
	// A held image is never deleted, so the cache may stay above MaxBytes
	// while its runs last; and the collection runs once a pull is in
	// place (an image's unpacked size is known only then), so the disk
	// holds up to one image more for a moment.
	MaxBytes int64
	// Transport reaches the registries; nil means go-containerregistry's
	// default (proxy from the environment, TLS verified).
	Transport http.RoundTripper
	// Log gets pulls, garbage collection and problems; never credentials.
	Log *slog.Logger
	// Now is the clock of last-use times; nil means time.Now.
	Now func() time.Time
	// BootID names this boot of the machine; "" reads the kernel's
	// (/proc/sys/kernel/random/boot_id). Images unpacked in an earlier
	// boot and not known to have reached the disk are dropped at start.
	BootID string
	// Changed, when not nil, is called after what Images returns has
	// changed (an image pulled or evicted, a new reference to one): the
	// agent republishes its inventory's locality report. It is called
	// without the cache's lock held and must not block.
	Changed func()
}

// Image is an image in the cache, as a run uses it.
type Image struct {
	// Digest is the image manifest's digest for Platform ("sha256:…"):
	// a reference to a multi-platform index resolves to one of its images.
	Digest string
	// RootFS is the unpacked root file system. It is shared by every run
	// of the image: mount it read-only (or as an overlay's lower layer),
	// never write to it.
	RootFS string
	// The image's config: what runs, as whom, where and with what
	// environment, unless the run says otherwise.
	Entrypoint []string
	Cmd        []string
	Env        []string
	User       string
	WorkingDir string
	// Size is the bytes the unpacked image takes on disk.
	Size int64
	// Lease names this hold. A runner that must survive an agent restart
	// keeps it with its run and calls Reclaim with it when it re-adopts
	// the run.
	Lease string
}

// Cached describes one cached image (for the inventory's locality report).
type Cached struct {
	Digest string
	// Refs are the references that resolved to the image here, fully
	// qualified ("registry.example/team/train:v3", "…@sha256:…").
	Refs     []string
	RootFS   string
	Size     int64
	LastUsed time.Time
	// Holds is how many holds (runs) use it now.
	Holds int
}

// meta is image.json.
type meta struct {
	Digest     string    `json:"digest"`
	Entrypoint []string  `json:"entrypoint,omitempty"`
	Cmd        []string  `json:"cmd,omitempty"`
	Env        []string  `json:"env,omitempty"`
	User       string    `json:"user,omitempty"`
	WorkingDir string    `json:"workingDir,omitempty"`
	Size       int64     `json:"size"`
	Download   int64     `json:"download"` // the layers' compressed bytes
	Pulled     time.Time `json:"pulled"`
	// Boot is the machine's boot ID when the image was unpacked: one of
	// an earlier boot that was never marked synced may be half written.
	Boot string `json:"boot,omitempty"`
}

// index is index.json.
type index struct {
	// Salt of the credential fingerprints in Refs.
	Salt string               `json:"salt"`
	Refs map[string]*refEntry `json:"refs"`
	// LastUsed per image digest: the last Acquire or release.
	LastUsed map[string]time.Time `json:"lastUsed"`
}

// refEntry is what the cache knows of one fully qualified reference.
type refEntry struct {
	// Digest is what the registry resolved the reference to: the image's
	// manifest, or a multi-platform index.
	Digest string `json:"digest"`
	// Image is the digest of the cached image it stands for.
	Image string `json:"image"`
	// Granted are the fingerprints of the credentials the registry
	// accepted for this reference (anonymousGrant: anyone's).
	Granted []string `json:"granted,omitempty"`
}

// Cache is the image cache of one machine. Its methods are safe for
// concurrent use; one Cache per Dir (the agent is the only writer).
type Cache struct {
	cfg    Config
	log    *slog.Logger
	images string
	tmp    string
	leases string
	index  string
	salt   string // of the credential fingerprints; set by New, then read only
	boot   string // this boot's ID, "" where unknown

	bg sync.WaitGroup // pulls, which may outlive their waiters

	mu    sync.Mutex
	idx   index
	meta  map[string]meta   // cached images by digest
	holds map[string]int    // holds per image digest
	live  map[string]string // lease → digest, this process's holds
	// orphans are the leases an earlier agent process left: their runs
	// may still be running, so their images stay held until Reclaim or
	// DropUnclaimed says what became of them.
	orphans map[string]string
	pulls   map[string]*pull // pulls in progress, by resolved digest
	overMax bool             // said once that every image left is held
}

// New opens the cache in cfg.Dir, creating it, deleting what a crash left
// half done, and keeping the images of the earlier process's leases held.
func New(cfg Config) (*Cache, error) {
	if cfg.Dir == "" {
		return nil, errors.New("image cache: no directory")
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	c := &Cache{
		cfg: cfg, log: cfg.Log,
		images: filepath.Join(cfg.Dir, "images"),
		tmp:    filepath.Join(cfg.Dir, "tmp"),
		leases: filepath.Join(cfg.Dir, "leases"),
		index:  filepath.Join(cfg.Dir, "index.json"),
		meta:   map[string]meta{}, holds: map[string]int{}, live: map[string]string{},
		orphans: map[string]string{}, pulls: map[string]*pull{},
		boot: cfg.BootID,
	}
	if c.boot == "" {
		if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
			c.boot = strings.TrimSpace(string(b))
		}
	}
	// tmp/ holds only unpacks that died with their process and deletions
	// that did not finish.
	if err := os.RemoveAll(c.tmp); err != nil {
		return nil, fmt.Errorf("image cache: clear %s: %w", c.tmp, err)
	}
	for _, d := range []string{c.images, c.tmp, c.leases} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("image cache: %w", err)
		}
	}
	if err := c.loadImages(); err != nil {
		return nil, err
	}
	c.loadIndex()
	c.salt = c.idx.Salt
	if err := c.loadLeases(); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.saveIndexLocked(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Cache) loadImages() error {
	entries, err := os.ReadDir(c.images)
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	for _, e := range entries {
		dir := filepath.Join(c.images, e.Name())
		m, err := readMeta(dir)
		if err != nil || m.Digest != "sha256:"+e.Name() {
			// Not something this cache renamed into place.
			c.log.Warn("image cache: removing an unreadable image", "dir", dir, "err", err)
			if err := os.RemoveAll(dir); err != nil {
				return fmt.Errorf("image cache: %w", err)
			}
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, syncedMarker)); err != nil {
			if m.Boot != c.boot && c.boot != "" {
				// The machine went down before the image was known to be
				// on disk: some of its files may be empty or missing.
				c.log.Warn("image cache: removing an image unpacked before a reboot and never synced", "digest", m.Digest)
				if err := os.RemoveAll(dir); err != nil {
					return fmt.Errorf("image cache: %w", err)
				}
				continue
			}
			c.syncLater(dir) // the process died before its sync; the files are whole in memory
		}
		c.meta[m.Digest] = m
	}
	return nil
}

func readMeta(dir string) (meta, error) {
	var m meta
	b, err := os.ReadFile(filepath.Join(dir, "image.json"))
	if err != nil {
		return m, err
	}
	err = json.Unmarshal(b, &m)
	return m, err
}

// loadIndex reads index.json; one that is missing or unreadable is
// rebuilt from the images on disk (their references are then unknown
// until pulled again: a tag resolves with the registry, as it would).
func (c *Cache) loadIndex() {
	b, err := os.ReadFile(c.index)
	if err == nil {
		err = json.Unmarshal(b, &c.idx)
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		c.log.Warn("image cache: index unreadable, rebuilt from the images", "err", err)
		c.idx = index{}
	}
	if c.idx.Salt == "" {
		c.idx.Salt = randomID()
	}
	if c.idx.Refs == nil {
		c.idx.Refs = map[string]*refEntry{}
	}
	if c.idx.LastUsed == nil {
		c.idx.LastUsed = map[string]time.Time{}
	}
	for n, e := range c.idx.Refs {
		if _, ok := c.meta[e.Image]; !ok {
			delete(c.idx.Refs, n)
		}
	}
	for d := range c.idx.LastUsed {
		if _, ok := c.meta[d]; !ok {
			delete(c.idx.LastUsed, d)
		}
	}
	for d, m := range c.meta {
		if _, ok := c.idx.LastUsed[d]; !ok {
			c.idx.LastUsed[d] = m.Pulled
		}
	}
}

func (c *Cache) loadLeases() error {
	entries, err := os.ReadDir(c.leases)
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	for _, e := range entries {
		p := filepath.Join(c.leases, e.Name())
		b, err := os.ReadFile(p)
		d := strings.TrimSpace(string(b))
		if _, ok := c.meta[d]; err != nil || !ok {
			c.log.Warn("image cache: dropping a lease of no cached image", "lease", e.Name(), "err", err)
			if err := os.Remove(p); err != nil {
				return fmt.Errorf("image cache: %w", err)
			}
			continue
		}
		c.orphans[e.Name()] = d
		c.holds[d]++
	}
	return nil
}

// saveIndexLocked writes index.json atomically. Lock should be held.
func (c *Cache) saveIndexLocked() error {
	b, err := json.MarshalIndent(c.idx, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(c.cfg.Dir, "index.json.*")
	if err != nil {
		return fmt.Errorf("image cache: save index: %w", err)
	}
	_, err = tmp.Write(b)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), c.index)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("image cache: save index: %w", err)
	}
	return nil
}

// saveIndex is saveIndexLocked for the paths where the index is a record
// of use, not of content: a failed write is logged, the hold stands.
func (c *Cache) saveIndexOrLogLocked() {
	if err := c.saveIndexLocked(); err != nil {
		c.log.Warn("image cache: index not saved", "err", err)
	}
}

func (c *Cache) imageDir(digest string) string {
	return filepath.Join(c.images, strings.TrimPrefix(digest, "sha256:"))
}

// Acquire returns the image ref names (a tag or a digest reference),
// pulled with auth if the cache does not have it for these credentials,
// and holds it until release is called (once; later calls do nothing).
// progress, when not nil, is called with the bytes of the layers
// downloaded so far and their total while a pull runs, from the pull's
// goroutine: it must not block.
//
// A reference by digest that was pulled here with these credentials (or
// anonymously) is served without asking the registry. Any other
// reference is resolved with the registry first (a HEAD request), which
// also checks that these credentials may read it: one tenant never gets
// another tenant's private image from this machine's cache by naming its
// digest. When the registry cannot be reached at all (no answer, as
// opposed to a refusal), a reference already resolved here with these
// credentials is served from the cache, so a registry outage does not
// stop jobs whose images the machine has; the tag may have moved since.
//
// Errors wrap ErrInvalidReference, ErrNotFound, ErrUnauthorized or
// ErrPullFailed, or are ctx's error.
func (c *Cache) Acquire(ctx context.Context, ref string, auth Auth, progress func(done, total int64)) (Image, func(), error) {
	r, err := name.ParseReference(ref)
	if err != nil {
		return Image{}, nil, fmt.Errorf("%w: %q: %v", ErrInvalidReference, ref, err)
	}
	fp := auth.fingerprint(c.salt)
	named := r.Name()
	if _, byDigest := r.(name.Digest); byDigest {
		if img, release, ok, err := c.fromCache(named, fp); ok || err != nil {
			return img, release, err
		}
	}
	top, err := c.resolve(ctx, r, auth)
	if err != nil {
		if !answered(err) && ctx.Err() == nil {
			if img, release, ok, cerr := c.fromCache(named, fp); ok || cerr != nil {
				c.log.Warn("image registry unreachable: running the image this reference resolved to before",
					"image", named, "digest", img.Digest, "err", err)
				return img, release, cerr
			}
		}
		return Image{}, nil, classify(ref, err)
	}
	byDigest := r.Context().Digest(top)
	names := []string{named}
	if byDigest.Name() != named {
		names = append(names, byDigest.Name())
	}
	w := &waiter{names: names, fp: fp, progress: progress}

	c.mu.Lock()
	if d, ok := c.imageOfLocked(top); ok {
		// The registry has just accepted these credentials for ref.
		newRef := c.recordLocked(names, top, d, fp)
		img, release, err := c.holdLocked(d)
		c.saveIndexOrLogLocked()
		c.mu.Unlock()
		if newRef {
			c.changed()
		}
		return img, release, err
	}
	p := c.pulls[top]
	if p == nil {
		// The pull outlives the first waiter's ctx as long as another
		// waits for it (and keeps its values: trace context, logger).
		pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		p = &pull{key: top, done: make(chan struct{}), waiters: map[*waiter]bool{}, cancel: cancel}
		c.pulls[top] = p
		c.bg.Add(1)
		go c.runPull(pctx, p, byDigest, auth)
	}
	p.waiters[w] = true
	p.records = append(p.records, w)
	c.mu.Unlock()

	select {
	case <-p.done:
		return w.img, w.release, w.err
	case <-ctx.Done():
		c.mu.Lock()
		if !p.completed {
			delete(p.waiters, w)
			if len(p.waiters) == 0 {
				// Nobody wants it any more; whoever comes next starts afresh.
				p.cancel()
				if c.pulls[top] == p {
					delete(c.pulls, top)
				}
			}
			c.mu.Unlock()
			return Image{}, nil, ctx.Err()
		}
		c.mu.Unlock()
		// The pull finished as ctx ended and made a hold for this waiter.
		if w.release != nil {
			w.release()
		}
		return Image{}, nil, ctx.Err()
	}
}

// fromCache holds the image named (a fully qualified reference) if it was
// resolved here with the credentials fp stands for.
func (c *Cache) fromCache(named, fp string) (Image, func(), bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.idx.Refs[named]
	if e == nil || !(slices.Contains(e.Granted, anonymousGrant) || slices.Contains(e.Granted, fp)) {
		return Image{}, nil, false, nil
	}
	if _, ok := c.meta[e.Image]; !ok {
		return Image{}, nil, false, nil
	}
	img, release, err := c.holdLocked(e.Image)
	c.saveIndexOrLogLocked()
	return img, release, true, err
}

// resolve asks the registry what ref names now: HEAD, then GET where HEAD
// fails with an answer (some registries do not serve HEAD, and only a
// GET carries the registry's error message).
func (c *Cache) resolve(ctx context.Context, r name.Reference, auth Auth) (string, error) {
	desc, err := remote.Head(r, c.options(ctx, auth)...)
	if err == nil {
		return desc.Digest.String(), nil
	}
	if !answered(err) {
		return "", err
	}
	full, gerr := remote.Get(r, c.options(ctx, auth)...)
	if gerr != nil {
		return "", gerr
	}
	return full.Digest.String(), nil
}

func (c *Cache) options(ctx context.Context, auth Auth) []remote.Option {
	o := []remote.Option{
		remote.WithContext(ctx),
		remote.WithAuth(auth.authenticator()),
		remote.WithPlatform(Platform),
		remote.WithUserAgent("gpuplane-node-agent"),
		// Fail over to the cache (or fail the attempt, which the scheduler
		// retries) within a second rather than go-containerregistry's
		// default of 1 s, 3 s, 9 s.
		remote.WithRetryBackoff(remote.Backoff{Duration: 100 * time.Millisecond, Factor: 2, Jitter: 0.1, Steps: 3}),
	}
	if c.cfg.Transport != nil {
		o = append(o, remote.WithTransport(c.cfg.Transport))
	}
	return o
}

// imageOfLocked is the cached image a resolved digest (an image manifest
// or an index) stands for. Lock should be held.
func (c *Cache) imageOfLocked(top string) (string, bool) {
	if _, ok := c.meta[top]; ok {
		return top, true
	}
	for _, e := range c.idx.Refs {
		if e.Digest == top {
			if _, ok := c.meta[e.Image]; ok {
				return e.Image, true
			}
		}
	}
	return "", false
}

// recordLocked notes that names resolve to top, which stands for image,
// and that the registry accepted fp for them; it reports whether a
// reference is new or moved. Lock should be held.
func (c *Cache) recordLocked(names []string, top, image, fp string) (moved bool) {
	for _, n := range names {
		e := c.idx.Refs[n]
		if e == nil || e.Digest != top || e.Image != image {
			// New, or a tag that moved: grants were for the old content.
			e = &refEntry{Digest: top, Image: image}
			c.idx.Refs[n] = e
			moved = true
		}
		if !slices.Contains(e.Granted, fp) {
			e.Granted = append(e.Granted, fp)
		}
	}
	return moved
}

func (c *Cache) changed() {
	if c.cfg.Changed != nil {
		c.cfg.Changed()
	}
}

// holdLocked holds a cached image with a new lease. Lock should be held.
func (c *Cache) holdLocked(digest string) (Image, func(), error) {
	m := c.meta[digest]
	lease := randomID()
	// The lease is on disk before the run can start, so an agent that
	// crashes with the run alive finds it.
	if err := os.WriteFile(filepath.Join(c.leases, lease), []byte(digest+"\n"), 0o600); err != nil {
		return Image{}, nil, fmt.Errorf("%w: hold %s: %v", ErrPullFailed, digest, err)
	}
	c.live[lease] = digest
	c.holds[digest]++
	c.idx.LastUsed[digest] = c.cfg.Now()
	return c.imageLocked(m, lease), c.releaser(lease), nil
}

func (c *Cache) imageLocked(m meta, lease string) Image {
	return Image{
		Digest: m.Digest, RootFS: filepath.Join(c.imageDir(m.Digest), "rootfs"),
		Entrypoint: m.Entrypoint, Cmd: m.Cmd, Env: m.Env, User: m.User, WorkingDir: m.WorkingDir,
		Size: m.Size, Lease: lease,
	}
}

func (c *Cache) releaser(lease string) func() {
	var once sync.Once
	return func() { once.Do(func() { c.release(lease) }) }
}

// release ends a hold: the image's last use is now (a long run keeps its
// image recent), and garbage collection may take it once no run holds it.
func (c *Cache) release(lease string) {
	c.mu.Lock()
	d, ok := c.live[lease]
	if !ok {
		c.mu.Unlock()
		return
	}
	delete(c.live, lease)
	c.unholdLocked(lease, d)
	victims := c.evictLocked()
	c.saveIndexOrLogLocked()
	c.mu.Unlock()
	c.discard(victims)
}

// unholdLocked drops one hold of d. Lock should be held.
func (c *Cache) unholdLocked(lease, d string) {
	if err := os.Remove(filepath.Join(c.leases, lease)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		c.log.Warn("image cache: lease not removed", "lease", lease, "err", err)
	}
	if c.holds[d]--; c.holds[d] <= 0 {
		delete(c.holds, d)
	}
	c.idx.LastUsed[d] = c.cfg.Now()
}

// Reclaim takes over a hold of an earlier agent process, named by the
// Image.Lease it returned, for a run the agent re-adopted: release it when
// that run ends.
func (c *Cache) Reclaim(lease string) (Image, func(), error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.orphans[lease]
	if !ok {
		return Image{}, nil, fmt.Errorf("image cache: lease %q: %w", lease, fs.ErrNotExist)
	}
	delete(c.orphans, lease)
	c.live[lease] = d
	return c.imageLocked(c.meta[d], lease), c.releaser(lease), nil
}

// DropUnclaimed releases the holds of an earlier agent process that no
// re-adopted run reclaimed: their runs ended while no agent watched.
// Call it once re-adoption is over; until then those images stay held.
func (c *Cache) DropUnclaimed() {
	c.mu.Lock()
	for lease, d := range c.orphans {
		delete(c.orphans, lease)
		c.unholdLocked(lease, d)
	}
	victims := c.evictLocked()
	c.saveIndexOrLogLocked()
	c.mu.Unlock()
	c.discard(victims)
}

// evictLocked takes the least recently used images that no run holds out
// of images/ until the cache is within MaxBytes, and returns where they
// went, for discard to delete outside the lock. Lock should be held.
func (c *Cache) evictLocked() []string {
	if c.cfg.MaxBytes <= 0 {
		return nil
	}
	var total int64
	var free []string
	for d, m := range c.meta {
		total += m.Size
		if c.holds[d] == 0 {
			free = append(free, d)
		}
	}
	slices.SortFunc(free, func(a, b string) int { return c.idx.LastUsed[a].Compare(c.idx.LastUsed[b]) })
	var victims []string
	for _, d := range free {
		if total <= c.cfg.MaxBytes {
			break
		}
		// A rename takes it out of sight at once; deleting the tree is slow.
		gone := filepath.Join(c.tmp, "gc-"+strings.TrimPrefix(d, "sha256:")+"-"+randomID())
		if err := os.Rename(c.imageDir(d), gone); err != nil {
			c.log.Warn("image cache: image not evicted", "digest", d, "err", err)
			continue
		}
		total -= c.meta[d].Size
		c.log.Info("image evicted", "digest", d, "bytes", c.meta[d].Size, "last_used", c.idx.LastUsed[d])
		delete(c.meta, d)
		delete(c.idx.LastUsed, d)
		for n, e := range c.idx.Refs {
			if e.Image == d {
				delete(c.idx.Refs, n)
			}
		}
		victims = append(victims, gone)
	}
	if over := total > c.cfg.MaxBytes; over && !c.overMax {
		c.log.Warn("image cache over its limit: every image left is held by a run", "bytes", total, "max_bytes", c.cfg.MaxBytes)
		c.overMax = true
	} else if !over {
		c.overMax = false
	}
	return victims
}

// discard deletes what evictLocked took out of sight, and says that the
// cache changed.
func (c *Cache) discard(dirs []string) {
	if len(dirs) > 0 {
		c.changed()
	}
	for _, d := range dirs {
		if err := os.RemoveAll(d); err != nil {
			c.log.Warn("image cache: evicted image not deleted (the next start deletes it)", "dir", d, "err", err)
		}
	}
}

// Close waits for the pulls in progress, which end soon after their last
// waiter gives up: call it when no Acquire is left waiting.
func (c *Cache) Close() {
	c.bg.Wait()
}

// Images lists the cached images, the most recently used first.
func (c *Cache) Images() []Cached {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]Cached, 0, len(c.meta))
	for d, m := range c.meta {
		e := Cached{Digest: d, RootFS: filepath.Join(c.imageDir(d), "rootfs"), Size: m.Size, LastUsed: c.idx.LastUsed[d], Holds: c.holds[d]}
		for n, r := range c.idx.Refs {
			if r.Image == d {
				e.Refs = append(e.Refs, n)
			}
		}
		slices.Sort(e.Refs)
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b Cached) int {
		if c := b.LastUsed.Compare(a.LastUsed); c != 0 {
			return c
		}
		return strings.Compare(a.Digest, b.Digest)
	})
	return out
}

func randomID() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b)
}
