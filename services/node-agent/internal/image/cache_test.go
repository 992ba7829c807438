package image_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// fakeClock moves a second per reading, so every last use is distinct.
type fakeClock struct{ n atomic.Int64 }

func (f *fakeClock) now() time.Time {
	return time.Unix(1_800_000_000+f.n.Add(1), 0).UTC()
}

func newCache(t testing.TB, cfg image.Config) *image.Cache {
	t.Helper()
	if cfg.Dir == "" {
		cfg.Dir = t.TempDir()
	}
	if cfg.Now == nil {
		cfg.Now = (&fakeClock{}).now
	}
	c, err := image.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// TestPullUnpacksImage: layers as registries serve them (gzip, zstd or
// plain tar) unpack to the image's file system, whiteouts applied, with
// the image's config, progress on the way, and the image listed.
func TestPullUnpacksImage(t *testing.T) {
	for _, comp := range []string{"gzip", "zstd", "none"} {
		t.Run(comp, func(t *testing.T) { testPullUnpacksImage(t, comp) })
	}
}

func testPullUnpacksImage(t *testing.T, comp string) {
	reg := startRegistry(t)
	digestRef := reg.push(t, "team/busybox:1", busyboxImageAs(t, "one", comp), image.Auth{})
	c := newCache(t, image.Config{})

	var mu sync.Mutex
	var calls [][2]int64
	img, release, err := c.Acquire(context.Background(), reg.host+"/team/busybox:1", image.Auth{}, func(done, total int64) {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, [2]int64{done, total})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer release()

	if want := digestRef[strings.Index(digestRef, "@")+1:]; img.Digest != want {
		t.Errorf("digest %s, want %s", img.Digest, want)
	}
	want := image.Image{
		Digest: img.Digest, RootFS: img.RootFS, Size: img.Size, Lease: img.Lease,
		Entrypoint: []string{"/bin/sh", "-c"}, Cmd: []string{"echo hello from one"},
		Env: []string{"PATH=/bin", "IMAGE_ID=one"}, User: "65534:65534", WorkingDir: "/tmp",
	}
	if diff := cmp.Diff(want, img); diff != "" {
		t.Errorf("image config (-want +got):\n%s", diff)
	}
	if img.Size < 1<<20 || img.Lease == "" {
		t.Errorf("size %d, lease %q: want a busybox's size and a lease", img.Size, img.Lease)
	}

	// The layers, whiteouts included, as a container will see them.
	bb, _ := os.ReadFile("/bin/busybox")
	got, err := os.ReadFile(filepath.Join(img.RootFS, "bin/busybox"))
	if err != nil || !bytes.Equal(got, bb) {
		t.Errorf("bin/busybox: %d bytes (%v), want %d", len(got), err, len(bb))
	}
	for p, link := range map[string]string{"bin/sh": "busybox", "bin/ls": "/bin/busybox"} {
		if l, err := os.Readlink(filepath.Join(img.RootFS, p)); err != nil || l != link {
			t.Errorf("%s links to %q (%v), want %q", p, l, err, link)
		}
	}
	files := map[string]string{}
	err = filepath.WalkDir(img.RootFS, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && !strings.HasPrefix(d.Name(), "busybox") && d.Name() != "hardlinked" {
			b, _ := os.ReadFile(p)
			rel, _ := filepath.Rel(img.RootFS, p)
			files[rel] = string(b)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	wantFiles := map[string]string{
		"etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
		"etc/kept":     "still here\n", // etc/removed: whited out
		"data/old/new": "new\n",        // data/old/a, sub/b: under an opaque whiteout
		"data/owned":   "setuid\n",
		"id":           "one\n",
	}
	if diff := cmp.Diff(wantFiles, files); diff != "" {
		t.Errorf("files (-want +got):\n%s", diff)
	}
	st1, err1 := os.Stat(filepath.Join(img.RootFS, "bin/busybox"))
	st2, err2 := os.Stat(filepath.Join(img.RootFS, "bin/hardlinked"))
	if err1 != nil || err2 != nil || !os.SameFile(st1, st2) {
		t.Errorf("bin/hardlinked is not a hard link of bin/busybox (%v, %v)", err1, err2)
	}
	if st, err := os.Stat(filepath.Join(img.RootFS, "data/owned")); err != nil || st.Mode()&os.ModeSetuid == 0 || st.Mode().Perm() != 0o750 {
		t.Errorf("data/owned mode %v (%v), want setuid 0750", st.Mode(), err)
	}
	if st, err := os.Stat(filepath.Join(img.RootFS, "data/owned")); err == nil && os.Geteuid() == 0 {
		if uid, gid := owner(st); uid != 1000 || gid != 1001 {
			t.Errorf("data/owned owned by %d:%d, want 1000:1001", uid, gid)
		}
	}

	// Progress: from 0 to the whole download, never backwards.
	mu.Lock()
	defer mu.Unlock()
	if len(calls) < 2 || calls[0][0] != 0 || calls[len(calls)-1][0] != calls[len(calls)-1][1] || calls[0][1] < 1<<18 {
		t.Fatalf("progress calls %v: want 0 first and done == total last", calls)
	}
	for i := 1; i < len(calls); i++ {
		// Strictly: a repeated report becomes a repeated pulling fact.
		if calls[i][0] <= calls[i-1][0] {
			t.Errorf("progress went backwards or repeated itself: %v", calls)
			break
		}
	}

	// What the inventory reports.
	cached := c.Images()
	if len(cached) != 1 || cached[0].Digest != img.Digest || cached[0].Holds != 1 ||
		!slices.Equal(cached[0].Refs, []string{reg.host + "/team/busybox:1", digestRef}) {
		t.Errorf("Images() = %+v, want the image with its tag and digest references, held once", cached)
	}
}

// TestCacheHits: what a second Acquire of a cached image asks of the
// registry.
func TestCacheHits(t *testing.T) {
	reg := startRegistry(t)
	digestRef := reg.push(t, "team/busybox:1", busyboxImage(t, "one"), image.Auth{})
	tagRef := reg.host + "/team/busybox:1"
	tests := map[string]struct {
		first, second string
		want          map[string]int // requests of the second Acquire
	}{
		"digest after digest": {digestRef, digestRef, map[string]int{}},
		"digest after tag":    {tagRef, digestRef, map[string]int{}},
		"tag after tag":       {tagRef, tagRef, map[string]int{"HEAD manifest": 1}},
		"tag after digest":    {digestRef, tagRef, map[string]int{"HEAD manifest": 1}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			c := newCache(t, image.Config{})
			first, release := acquire(t, c, tt.first, image.Auth{})
			release()
			reg.reset()
			second, release := acquire(t, c, tt.second, image.Auth{})
			defer release()
			if second.RootFS != first.RootFS || second.Digest != first.Digest {
				t.Errorf("second acquire got %s, want the cached %s", second.RootFS, first.RootFS)
			}
			got := map[string]int{}
			for _, k := range []string{"HEAD manifest", "GET manifest", "GET blob", "HEAD blob"} {
				if n := reg.count(k); n > 0 {
					got[k] = n
				}
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("registry requests of a cache hit (-want +got):\n%s", diff)
			}
		})
	}
}

// TestConcurrentPullsShareOneDownload: eight runs starting with one image
// at once download each layer once.
func TestConcurrentPullsShareOneDownload(t *testing.T) {
	reg := startRegistry(t)
	img := busyboxImage(t, "one")
	reg.push(t, "team/busybox:1", img, image.Auth{})
	reg.reset()
	c := newCache(t, image.Config{})

	const n = 8
	var wg sync.WaitGroup
	got := make([]image.Image, n)
	releases := make([]func(), n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			got[i], releases[i], errs[i] = c.Acquire(context.Background(), reg.host+"/team/busybox:1", image.Auth{}, nil)
		})
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Fatalf("acquire %d: %v", i, errs[i])
		}
		defer releases[i]()
		if got[i].RootFS != got[0].RootFS {
			t.Errorf("acquire %d got %s, want %s", i, got[i].RootFS, got[0].RootFS)
		}
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range layers {
		d, _ := l.Digest()
		if k := reg.count("GET blob " + d.String()); k != 1 {
			t.Errorf("layer %s downloaded %d times, want once", d, k)
		}
	}
	if h := c.Images()[0].Holds; h != n {
		t.Errorf("holds %d, want %d", h, n)
	}
}

// TestGCKeepsHeldImagesAndEvictsLeastRecentlyUsed: past MaxBytes the
// least recently used image that no run holds goes, never a held one.
func TestGCKeepsHeldImagesAndEvictsLeastRecentlyUsed(t *testing.T) {
	reg := startRegistry(t)
	refs := map[string]string{}
	for _, id := range []string{"a", "b", "c"} {
		reg.push(t, "team/img-"+id+":1", busyboxImage(t, id), image.Auth{})
		refs[id] = reg.host + "/team/img-" + id + ":1"
	}
	// Each image is about one busybox; room for two and a half.
	probe := newCache(t, image.Config{})
	a, release := acquire(t, probe, refs["a"], image.Auth{})
	release()
	max := a.Size * 5 / 2 // the three differ by a few bytes of their last layer

	cached := func(c *image.Cache) []string {
		var ids []string
		for _, e := range c.Images() {
			b, err := os.ReadFile(filepath.Join(e.RootFS, "id"))
			if err != nil {
				t.Fatalf("listed image %s has no rootfs: %v", e.Digest, err)
			}
			ids = append(ids, strings.TrimSpace(string(b)))
		}
		slices.Sort(ids)
		return ids
	}

	t.Run("the least recently used unheld image goes", func(t *testing.T) {
		c := newCache(t, image.Config{MaxBytes: max})
		_, releaseA := acquire(t, c, refs["a"], image.Auth{}) // held throughout
		defer releaseA()
		_, releaseB := acquire(t, c, refs["b"], image.Auth{})
		releaseB()
		_, releaseC := acquire(t, c, refs["c"], image.Auth{})
		if got := cached(c); !slices.Equal(got, []string{"a", "c"}) {
			t.Fatalf("cached %v after a (held), b (released), c: want a and c", got)
		}
		releaseC()
		// b comes back: c is the least recently used of the unheld.
		_, releaseB = acquire(t, c, refs["b"], image.Auth{})
		defer releaseB()
		if got := cached(c); !slices.Equal(got, []string{"a", "b"}) {
			t.Errorf("cached %v after c released and b pulled again: want a (held) and b", got)
		}
	})
	t.Run("held images stay over the limit", func(t *testing.T) {
		c := newCache(t, image.Config{MaxBytes: a.Size})
		for _, id := range []string{"a", "b", "c"} {
			_, release := acquire(t, c, refs[id], image.Auth{})
			defer release()
		}
		if got := cached(c); !slices.Equal(got, []string{"a", "b", "c"}) {
			t.Errorf("cached %v with all three held: want all three", got)
		}
	})
	t.Run("last use is the release", func(t *testing.T) {
		c := newCache(t, image.Config{MaxBytes: max})
		_, ra := acquire(t, c, refs["a"], image.Auth{})
		_, rb := acquire(t, c, refs["b"], image.Auth{})
		rb() // b was acquired after a, but a's run lasts longer
		ra()
		_, rc := acquire(t, c, refs["c"], image.Auth{})
		defer rc()
		if got := cached(c); !slices.Equal(got, []string{"a", "c"}) {
			t.Errorf("cached %v after b then a released and c pulled: want a and c", got)
		}
	})
	t.Run("a release under pressure collects", func(t *testing.T) {
		c := newCache(t, image.Config{MaxBytes: max})
		_, ra := acquire(t, c, refs["a"], image.Auth{})
		_, rb := acquire(t, c, refs["b"], image.Auth{})
		_, rc := acquire(t, c, refs["c"], image.Auth{})
		defer ra()
		defer rc()
		rb()
		if got := cached(c); !slices.Equal(got, []string{"a", "c"}) {
			t.Errorf("cached %v after b released over the limit: want a and c", got)
		}
	})
}

// TestRestartKeepsRunningImages: an agent that restarts while its runs go
// on finds their holds, and its garbage collection keeps their images
// until re-adoption says which runs are gone.
func TestRestartKeepsRunningImages(t *testing.T) {
	reg := startRegistry(t)
	refs := map[string]string{}
	for _, id := range []string{"a", "b", "c"} {
		reg.push(t, "team/img-"+id+":1", busyboxImage(t, id), image.Auth{})
		refs[id] = reg.host + "/team/img-" + id + ":1"
	}
	dir := t.TempDir()
	clock := &fakeClock{}
	before := newCache(t, image.Config{Dir: dir, Now: clock.now})
	a, _ := acquire(t, before, refs["a"], image.Auth{}) // the run of a survives the agent
	b, _ := acquire(t, before, refs["b"], image.Auth{}) // the run of b ends while no agent runs
	// The agent dies: no release.

	// A limit of one byte: every image that no run holds goes.
	after := newCache(t, image.Config{Dir: dir, Now: clock.now, MaxBytes: 1})
	_, releaseC := acquire(t, after, refs["c"], image.Auth{})
	releaseC()
	for _, img := range []image.Image{a, b} {
		if _, err := os.Stat(img.RootFS); err != nil {
			t.Fatalf("image %s of a run alive across the restart was collected: %v", img.Digest, err)
		}
	}
	// Re-adoption: a's run is alive, b's is not.
	got, releaseA, err := after.Reclaim(a.Lease)
	if err != nil || got.RootFS != a.RootFS {
		t.Fatalf("Reclaim(%s) = %s, %v; want %s", a.Lease, got.RootFS, err, a.RootFS)
	}
	if _, _, err := after.Reclaim("no-such-lease"); err == nil {
		t.Error("Reclaim of an unknown lease succeeded")
	}
	after.DropUnclaimed()
	if _, err := os.Stat(b.RootFS); err == nil {
		t.Error("the image of a run that ended while the agent was down outlived DropUnclaimed")
	}
	if _, err := os.Stat(a.RootFS); err != nil {
		t.Fatalf("the image of a re-adopted run was collected: %v", err)
	}
	releaseA()
	if _, err := os.Stat(a.RootFS); err == nil {
		t.Error("a's image outlived its last run")
	}
}

// TestPullErrors: each failure wraps the error its reason is made from,
// and no error or log line carries a credential.
func TestPullErrors(t *testing.T) {
	const password = "s3cret-password-value"
	open := startRegistry(t)
	openRef := open.push(t, "team/busybox:1", busyboxImage(t, "one"), image.Auth{})
	private := startRegistry(t)
	private.requireAuth(map[string]string{"alice": password})
	privateRef := private.push(t, "team/busybox:1", busyboxImage(t, "one"), image.Auth{Username: "alice", Password: password})
	broken := startRegistry(t)
	broken.push(t, "team/busybox:1", busyboxImage(t, "one"), image.Auth{})
	broken.failWith = "storage backend is read-only"
	gone := startRegistry(t)
	gone.srv.Close()

	tests := map[string]struct {
		ref  string
		auth image.Auth
		want error
		says string
	}{
		"no such repository":   {open.host + "/team/nothing:1", image.Auth{}, image.ErrNotFound, "NAME_UNKNOWN"},
		"no such tag":          {open.host + "/team/busybox:2", image.Auth{}, image.ErrNotFound, ""},
		"no such digest":       {open.host + "/team/busybox@sha256:" + strings.Repeat("0", 64), image.Auth{}, image.ErrNotFound, ""},
		"wrong password":       {private.host + "/team/busybox:1", image.Auth{Username: "alice", Password: "wrong-" + password}, image.ErrUnauthorized, ""},
		"no credentials":       {private.host + "/team/busybox:1", image.Auth{}, image.ErrUnauthorized, ""},
		"wrong token":          {private.host + "/team/busybox:1", image.Auth{Username: "alice", Token: "x" + password}, image.ErrUnauthorized, ""},
		"bad reference":        {"Not A/Reference!!", image.Auth{}, image.ErrInvalidReference, ""},
		"registry error":       {broken.host + "/team/busybox:1", image.Auth{}, image.ErrPullFailed, "storage backend is read-only"},
		"registry unreachable": {gone.host + "/team/busybox:1", image.Auth{Username: "alice", Password: password}, image.ErrPullFailed, ""},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			var logs bytes.Buffer
			c := newCache(t, image.Config{Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
			_, _, err := c.Acquire(context.Background(), tt.ref, tt.auth, nil)
			if !errors.Is(err, tt.want) {
				t.Fatalf("Acquire(%s) = %v, want %v", tt.ref, err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.says) {
				t.Errorf("error %q does not say %q", err, tt.says)
			}
			if strings.Contains(err.Error()+logs.String(), password) {
				t.Errorf("the password leaked: %v\n%s", err, logs.String())
			}
			if len(c.Images()) != 0 {
				t.Errorf("a failed pull left %+v", c.Images())
			}
		})
	}
	// The right credentials pull, and neither the logs nor the index on
	// disk hold them.
	var logs bytes.Buffer
	dir := t.TempDir()
	c := newCache(t, image.Config{Dir: dir, Log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	auth := image.Auth{Username: "alice", Password: password}
	_, release := acquire(t, c, privateRef, auth)
	release()
	idx, err := os.ReadFile(filepath.Join(dir, "index.json"))
	if err != nil {
		t.Fatal(err)
	}
	for what, s := range map[string]string{"logs": logs.String(), "index": string(idx), "fmt": auth.String() + slog.AnyValue(auth).String()} {
		if strings.Contains(s, password) {
			t.Errorf("the password is in the %s: %s", what, s)
		}
	}
	_ = openRef
}

// TestCachedPrivateImageNeedsCredentials: a digest cached for one tenant
// is not served to credentials the registry would refuse.
func TestCachedPrivateImageNeedsCredentials(t *testing.T) {
	reg := startRegistry(t)
	users := map[string]string{"alice": "alice-pw", "bob": "bob-pw"}
	reg.requireAuth(users)
	alice := image.Auth{Username: "alice", Password: "alice-pw"}
	ref := reg.push(t, "team/busybox:1", busyboxImage(t, "one"), alice)
	c := newCache(t, image.Config{})
	first, release := acquire(t, c, ref, alice)
	release()

	reg.reset()
	if _, _, err := c.Acquire(context.Background(), ref, image.Auth{Username: "mallory", Password: "guess"}, nil); !errors.Is(err, image.ErrUnauthorized) {
		t.Errorf("a cached digest with wrong credentials: %v, want ErrUnauthorized", err)
	}
	// bob may read the repository: the registry says so (one HEAD), the
	// layers come from the cache.
	got, release := acquire(t, c, ref, image.Auth{Username: "bob", Password: "bob-pw"})
	release()
	if got.RootFS != first.RootFS || reg.count("GET blob") != 0 || reg.count("HEAD manifest") == 0 {
		t.Errorf("bob got %s with %d blob downloads, %d HEADs; want the cached %s, no download, a HEAD",
			got.RootFS, reg.count("GET blob"), reg.count("HEAD manifest"), first.RootFS)
	}
}

// TestOfflineFromCache: with its registry down, a tag seen here before
// runs from the cache; anything else fails with ErrPullFailed.
func TestOfflineFromCache(t *testing.T) {
	reg := startRegistry(t)
	reg.requireAuth(map[string]string{"alice": "alice-pw", "bob": "bob-pw"})
	alice := image.Auth{Username: "alice", Password: "alice-pw"}
	reg.push(t, "team/busybox:1", busyboxImage(t, "one"), alice)
	reg.push(t, "team/busybox:2", busyboxImage(t, "two"), alice)
	c := newCache(t, image.Config{})
	tag := reg.host + "/team/busybox:1"
	first, release := acquire(t, c, tag, alice)
	release()
	reg.srv.Close()

	got, release := acquire(t, c, tag, alice)
	release()
	if got.RootFS != first.RootFS {
		t.Errorf("offline: got %s, want the cached %s", got.RootFS, first.RootFS)
	}
	for ref, auth := range map[string]image.Auth{
		reg.host + "/team/busybox:2": alice,                                 // never seen
		tag:                          {Username: "bob", Password: "bob-pw"}, // never granted here
	} {
		if _, _, err := c.Acquire(context.Background(), ref, auth, nil); !errors.Is(err, image.ErrPullFailed) {
			t.Errorf("offline %s as %s: %v, want ErrPullFailed", ref, auth, err)
		}
	}
}

// TestChangedSaysWhenImagesChange: Config.Changed (the agent's cue to
// republish its inventory) follows what Images lists: a pull, a new
// reference, an eviction; not a cache hit.
func TestChangedSaysWhenImagesChange(t *testing.T) {
	reg := startRegistry(t)
	digestRef := reg.push(t, "team/busybox:1", busyboxImage(t, "one"), image.Auth{})
	reg.push(t, "team/busybox:latest", busyboxImage(t, "one"), image.Auth{})
	var changes atomic.Int32
	// A limit of one byte: an image goes as soon as no run holds it.
	c := newCache(t, image.Config{MaxBytes: 1, Changed: func() { changes.Add(1) }})
	var releases []func()
	hold := func(ref string) func() {
		return func() {
			_, release := acquire(t, c, ref, image.Auth{})
			releases = append(releases, release)
		}
	}
	steps := []struct {
		what string
		do   func()
		want int32
	}{
		{"a pull", hold(reg.host + "/team/busybox:1"), 1},
		{"a hit by digest", hold(digestRef), 1},
		{"a new tag of the image", hold(reg.host + "/team/busybox:latest"), 2},
		{"all released: evicted", func() {
			for _, r := range releases {
				r()
			}
		}, 3},
	}
	for _, s := range steps {
		s.do()
		if got := changes.Load(); got != s.want {
			t.Fatalf("after %s: %d changes, want %d", s.what, got, s.want)
		}
	}
	if len(c.Images()) != 0 {
		t.Errorf("Images() = %+v after the eviction", c.Images())
	}
}
