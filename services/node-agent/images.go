package nodeagent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sys/unix"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/telemetry"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci"
)

// The agent's part in container images (internal/image): a container
// run's launch acquires its image with its tenant's registry login,
// reporting the pull's progress as pulling facts; the run's end releases
// it; the inventory lists the cached images (the scheduler's locality
// score) and is republished when they change.
//
//	onCommitted ──acquireImage──▶ registry login (BucketRegistryCredentials)
//	                 │            ──▶ Cache.Acquire ──progress──▶ RunEvent{pulling}
//	                 ├─ ok ──▶ oci.Image{RootFS, Lease} ──▶ Launch
//	                 └─ failed ──▶ imageReason: image_not_found, image_unauthorized, image_pull_failed, image_invalid
//	Cache.Changed ──▶ republish the inventory (Images)

// MaxInventoryImages bounds the inventory's list of cached images (each
// image by digest and by the references it was pulled as), the most
// recently used first: the scheduler needs the images jobs ask for now,
// and an inventory must stay a small message.
const MaxInventoryImages = 256

// imageStore is the machine's image cache as the agent holds it. The
// cache is opened at the first container run, or at start where an
// earlier agent left one (its images are in the inventory, and the holds
// of its runs are kept), so an agent that never runs a container writes
// nothing for it.
type imageStore struct {
	dir       string // "" until needed: a new temporary directory
	maxBytes  int64
	transport http.RoundTripper
	log       *slog.Logger
	now       func() time.Time
	changed   func()

	mu    sync.Mutex
	cache *image.Cache

	// pulls bounds the references acquired at once (MaxConcurrentPulls):
	// runs of one reference share a slot, as they share the cache's pull.
	pulls pullSlots
}

// MaxConcurrentPulls is how many image references a machine acquires at
// once. Each container run pulls from its own goroutine (runs.go), so
// that a slow pull holds up no other run; this bound keeps a burst of
// commits for many images from splitting the machine's bandwidth and
// disk between them all, which would delay every one of them.
const MaxConcurrentPulls = 4

// pullSlots is a counting semaphore whose slots are image references.
type pullSlots struct {
	mu    sync.Mutex
	users map[string]int // references holding a slot: the runs using each
	freed chan struct{}  // closed (and replaced) when a slot is given back
}

// acquire waits for ref's slot (taken by the first run of ref, shared
// with the others), or for ctx; release gives it back once every run of
// ref has.
func (p *pullSlots) acquire(ctx context.Context, ref string) (release func(), err error) {
	p.mu.Lock()
	if p.users == nil {
		p.users, p.freed = map[string]int{}, make(chan struct{})
	}
	for p.users[ref] == 0 && len(p.users) >= MaxConcurrentPulls {
		freed := p.freed
		p.mu.Unlock()
		select {
		case <-freed:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		p.mu.Lock()
	}
	p.users[ref]++
	p.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.users[ref]--; p.users[ref] == 0 {
				delete(p.users, ref)
				close(p.freed)
				p.freed = make(chan struct{})
			}
		})
	}, nil
}

func newImageStore(cfg Config, log *slog.Logger, changed func()) *imageStore {
	dir := cfg.ImageDir
	if dir == "" && cfg.LogDir != "" {
		dir = filepath.Join(cfg.LogDir, "images")
	}
	return &imageStore{dir: dir, maxBytes: cfg.ImageCacheMaxBytes, transport: cfg.ImageTransport, log: log, now: cfg.Now, changed: changed}
}

// get returns the cache, opening it if need be.
func (s *imageStore) get() (*image.Cache, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache != nil {
		return s.cache, nil
	}
	if s.dir == "" {
		dir, err := os.MkdirTemp("", "gpuplane-images-*")
		if err != nil {
			return nil, fmt.Errorf("image cache: %w", err)
		}
		s.dir = dir
	}
	if err := os.MkdirAll(s.dir, 0o700); err != nil {
		return nil, fmt.Errorf("image cache: %w", err)
	}
	max := s.maxBytes
	if max == 0 {
		max = defaultImageCacheBytes(s.dir)
	}
	c, err := image.New(image.Config{Dir: s.dir, MaxBytes: max, Transport: s.transport, Log: s.log, Now: s.now, Changed: s.changed})
	if err != nil {
		return nil, err
	}
	s.log.Info("image cache opened", "dir", s.dir, "max_bytes", max)
	s.cache = c
	return c, nil
}

// openExisting opens the cache at start when an earlier agent left one.
func (s *imageStore) openExisting() error {
	if s.dir == "" {
		return nil
	}
	if _, err := os.Stat(filepath.Join(s.dir, "index.json")); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	_, err := s.get()
	return err
}

// opened is the cache if it is open, nil otherwise.
func (s *imageStore) opened() *image.Cache {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cache
}

// close waits for the pulls in progress (their waiters are gone when
// the agent stops).
func (s *imageStore) close() {
	if c := s.opened(); c != nil {
		c.Close()
	}
}

// defaultImageCacheBytes is half the file system that holds dir: images
// share the disk with run logs, checkpoints and scratch, and a cache that
// filled it would fail the runs it serves. Unknown: 64 GiB.
func defaultImageCacheBytes(dir string) int64 {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil || st.Blocks == 0 {
		return 64 << 30
	}
	return int64(st.Blocks) * st.Bsize / 2
}

// inventory is the locality report: each cached image by digest and by
// the references it was pulled as (contracts.ImageRef's form), the most
// recently used first, at most MaxInventoryImages names.
func (s *imageStore) inventory() []string {
	c := s.opened()
	if c == nil {
		return nil
	}
	var out []string
	for _, img := range c.Images() {
		for _, n := range append([]string{img.Digest}, img.Refs...) {
			if len(out) == MaxInventoryImages {
				return out
			}
			out = append(out, n)
		}
	}
	return out
}

// reclaimImage takes over, for a container run a restarted agent
// re-adopts, the image hold its launch took (oci.Image.Lease): release
// ends it with the run. Until then, and until dropUnclaimedImages, every
// hold of the previous agent stays: no image of a running container is
// collected.
func (a *agent) reclaimImage(lease string) (release func(), err error) {
	c := a.images.opened()
	if c == nil || lease == "" {
		return func() {}, nil
	}
	_, release, err = c.Reclaim(lease)
	if err != nil {
		return func() {}, err
	}
	return release, nil
}

// dropUnclaimedImages gives back the holds of the previous agent that no
// re-adopted run reclaimed (their runs ended while no agent ran). Call it
// only once every re-adopted run reclaimed its image.
func (a *agent) dropUnclaimedImages() {
	if c := a.images.opened(); c != nil {
		c.DropUnclaimed()
	}
}

// onImagesChange asks for the inventory to be republished with the
// cache's new content. It only signals: the cache calls it from a pull.
func (a *agent) onImagesChange() {
	select {
	case a.imagesChanged <- struct{}{}:
	default: // one republish pending already covers this change
	}
}

// republishOnImagesChange publishes the inventory each time the cached
// images changed, until ctx ends.
func (a *agent) republishOnImagesChange(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-a.imagesChanged:
		}
		if err := a.publishInventory(ctx, a.nextInventoryVersion()); err != nil && ctx.Err() == nil {
			a.log.Warn("inventory with the new cached images not published; the next change or interval tries again", "err", err)
		}
	}
}

// registryAuth is tenant's login to the registry of ref, as stored in
// BucketRegistryCredentials; the zero Auth (an anonymous pull) where the
// tenant stored none for that registry. The login is never logged.
func (a *agent) registryAuth(ctx context.Context, tenant string, ref string) (image.Auth, error) {
	r, err := contracts.ParseImage(ref)
	if err != nil {
		return image.Auth{}, fmt.Errorf("%w: %v", image.ErrInvalidReference, err)
	}
	kv, err := a.bus.KeyValue(ctx, contracts.BucketRegistryCredentials)
	if err != nil {
		return image.Auth{}, fmt.Errorf("registry credentials: %w", err)
	}
	e, err := kv.Get(ctx, tenant)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return image.Auth{}, nil
	}
	if err != nil {
		return image.Auth{}, fmt.Errorf("registry credentials of %s: %w", tenant, err)
	}
	var creds contracts.RegistryCredentials
	if err := json.Unmarshal(e.Value(), &creds); err != nil {
		// Say which tenant, never what the value holds.
		return image.Auth{}, fmt.Errorf("registry credentials of %s do not decode", tenant)
	}
	login, ok := creds.For(r)
	if !ok {
		return image.Auth{}, nil
	}
	return image.Auth{Username: login.Username, Password: login.Password, Token: login.Token}, nil
}

// acquireImage holds alloc's image for its run, pulling it if need be
// with the tenant's registry login, and reports the pull's progress as
// pulling facts. release gives the hold back when the run has ended. An
// error is a failed attempt: imageReason names its reason.
func (a *agent) acquireImage(ctx context.Context, alloc contracts.Allocation) (oci.Image, func(), error) {
	ref := alloc.Run.Image
	auth, err := a.registryAuth(ctx, alloc.Tenant, ref)
	if err != nil {
		return oci.Image{}, nil, err
	}
	cache, err := a.images.get()
	if err != nil {
		return oci.Image{}, nil, err
	}
	slot, err := a.images.pulls.acquire(ctx, ref)
	if err != nil {
		return oci.Image{}, nil, err
	}
	rep := newPullReporter(a, alloc)
	img, release, err := cache.Acquire(ctx, ref, auth, rep.progress)
	slot()
	rep.close(ctx)
	if err != nil {
		return oci.Image{}, nil, err
	}
	return oci.Image{Ref: ref, Digest: img.Digest, RootFS: img.RootFS, Entrypoint: img.Entrypoint, Cmd: img.Cmd,
		Env: img.Env, User: img.User, WorkingDir: img.WorkingDir, Lease: img.Lease}, release, nil
}

// imageReason is the reason of a run whose image could not be had.
func imageReason(err error) contracts.Reason {
	switch {
	case errors.Is(err, image.ErrInvalidReference):
		return contracts.ReasonImageInvalid
	case errors.Is(err, image.ErrNotFound):
		return contracts.ReasonImageNotFound
	case errors.Is(err, image.ErrUnauthorized):
		return contracts.ReasonImageUnauthorized
	}
	return contracts.ReasonImagePullFailed
}

// pullReporter publishes a pull's progress as pulling facts from its own
// goroutine: the cache calls progress from the pull, which must not wait
// for the bus. Only the latest report not yet sent is kept.
type pullReporter struct {
	a     *agent
	alloc contracts.Allocation
	wake  chan struct{}
	done  chan struct{}

	mu      sync.Mutex
	pending *contracts.PullProgress
	running bool // the publisher started (at the first report: a hit reports nothing)
	closed  bool // the launch has its image, or gave up
}

func newPullReporter(a *agent, alloc contracts.Allocation) *pullReporter {
	return &pullReporter{a: a, alloc: alloc, wake: make(chan struct{}, 1), done: make(chan struct{})}
}

func (r *pullReporter) progress(done, total int64) {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return // a report from a pull this launch no longer waits for
	}
	r.pending = &contracts.PullProgress{Image: r.alloc.Run.Image, Done: done, Total: total}
	if !r.running {
		r.running = true
		go r.run()
	}
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *pullReporter) run() {
	defer close(r.done)
	seq := 0
	for {
		r.mu.Lock()
		p, closed := r.pending, r.closed
		r.pending = nil
		r.mu.Unlock()
		switch {
		case p != nil:
			r.publish(p, seq)
			seq++
			continue
		case closed:
			return
		}
		<-r.wake
	}
}

// close waits until the last report is out (or ctx ends).
func (r *pullReporter) close(ctx context.Context) {
	r.mu.Lock()
	r.closed = true
	running := r.running
	r.mu.Unlock()
	if !running {
		return
	}
	select {
	case r.wake <- struct{}{}:
	default:
	}
	select {
	case <-r.done:
	case <-ctx.Done():
	}
}

// publish sends one pulling fact. It is not recorded as a run fact: an
// allocation with only pulling facts has not started, and a restarted
// agent must still start it.
func (r *pullReporter) publish(p *contracts.PullProgress, seq int) {
	a, alloc := r.a, r.alloc
	// The launch's context may end first; one report is bounded alone.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ctx = telemetry.WithTraceParent(ctx, alloc.TraceParent)
	ev := contracts.RunEvent{SchemaVersion: contracts.SchemaVersion, Kind: contracts.RunPulling, AllocationID: alloc.ID,
		Tenant: alloc.Tenant, JobID: alloc.JobID, Attempt: alloc.Attempt, NodeID: a.cfg.NodeID, Devices: alloc.Devices,
		Time: a.cfg.Now(), Pull: p}
	if _, err := a.bus.Publish(ctx, contracts.SubjectRuns(a.cfg.NodeID), contracts.RunPullingID(alloc.ID, seq),
		ev, bus.CESubject(alloc.ID)); err != nil {
		a.log.Warn("pulling fact not published", "allocation_id", alloc.ID, "err", err)
	}
}
