package nodeagent

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
)

// imageBed is a NATS server with the admin's and one node agent's
// connections, and a registry on 127.0.0.1 that wants alice's password.
type imageBed struct {
	srv   *natsserver.Server
	admin *bus.Bus // writes the registry credentials, reads the run facts
	agent *agent   // only what acquireImage and registryAuth use
	reg   string   // the registry's host:port
}

const (
	imageTestNode = "img-01"
	alicePassword = "alice-registry-password"
)

func newImageBed(t *testing.T) *imageBed {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	op, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "test", CredsFile: natstest.Operator(t, srv),
		Streams: contracts.StreamOptions{Memory: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = op.Close(context.Background()) })
	admin, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: "admin", SkipProvision: true,
		CredsFile: natstest.Service(t, srv, contracts.BusAdmin)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close(context.Background()) })
	nb, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: ServiceName + "-" + imageTestNode, SkipProvision: true,
		CredsFile: natstest.Node(t, srv, imageTestNode)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = nb.Close(context.Background()) })

	inner := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	rs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "alice" || p != alicePassword {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			http.Error(w, `{"errors":[{"code":"UNAUTHORIZED","message":"who are you"}]}`, http.StatusUnauthorized)
			return
		}
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(rs.Close)

	cfg := Config{NodeID: imageTestNode, Now: time.Now, ImageDir: t.TempDir()}
	log := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	a := &agent{cfg: cfg, bus: nb, log: log, imagesChanged: make(chan struct{}, 1)}
	a.images = newImageStore(cfg, log, a.onImagesChange)
	t.Cleanup(a.images.close)
	return &imageBed{srv: srv, admin: admin, agent: a, reg: strings.TrimPrefix(rs.URL, "http://")}
}

// push uploads img as repoTag with alice's login and returns its digest.
func (b *imageBed) push(t *testing.T, repoTag string, img v1.Image) string {
	t.Helper()
	ref, err := name.ParseReference(b.reg + "/" + repoTag)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img, remote.WithAuth(authn.FromConfig(authn.AuthConfig{Username: "alice", Password: alicePassword}))); err != nil {
		t.Fatal(err)
	}
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d.String()
}

// storeLogin writes tenant's registry logins as an administrator does.
func (b *imageBed) storeLogin(t *testing.T, tenant string, value []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kv, err := b.admin.KeyValue(ctx, contracts.BucketRegistryCredentials)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, tenant, value); err != nil {
		t.Fatal(err)
	}
}

func loginJSON(t *testing.T, tenant string, regs map[string]contracts.RegistryAuth) []byte {
	t.Helper()
	b, err := json.Marshal(contracts.RegistryCredentials{SchemaVersion: contracts.SchemaVersion, Tenant: tenant, Registries: regs})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRegistryAuthFromTheBucket: the agent pulls with the login its
// tenant stored for the image's registry, anonymously where there is none,
// and says nothing of a login it cannot read.
func TestRegistryAuthFromTheBucket(t *testing.T) {
	b := newImageBed(t)
	b.storeLogin(t, "acme", loginJSON(t, "acme", map[string]contracts.RegistryAuth{
		b.reg:     {Username: "alice", Password: alicePassword},
		"ghcr.io": {Token: "ghcr-token"},
	}))
	b.storeLogin(t, "broken", []byte(`{"registries": {"`+b.reg+`": "`+alicePassword+`"`))
	tests := map[string]struct {
		tenant, ref string
		want        image.Auth
		wantErr     error
	}{
		"the tenant's login for the registry": {"acme", b.reg + "/team/app:1", image.Auth{Username: "alice", Password: alicePassword}, nil},
		"a token":                             {"acme", "ghcr.io/acme/app@sha256:" + strings.Repeat("a", 64), image.Auth{Token: "ghcr-token"}, nil},
		"no login for that registry":          {"acme", "busybox", image.Auth{}, nil},
		"a tenant with no logins":             {"other", b.reg + "/team/app:1", image.Auth{}, nil},
		"a bad reference":                     {"acme", "Bad Ref", image.Auth{}, image.ErrInvalidReference},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			got, err := b.agent.registryAuth(context.Background(), tt.tenant, tt.ref)
			if !errors.Is(err, tt.wantErr) || got != tt.want {
				t.Errorf("registryAuth(%s, %s) = %v, %v; want %v, %v", tt.tenant, tt.ref, got, err, tt.want, tt.wantErr)
			}
		})
	}
	_, err := b.agent.registryAuth(context.Background(), "broken", b.reg+"/team/app:1")
	if err == nil || strings.Contains(err.Error(), alicePassword) {
		t.Errorf("an unreadable login: %v; want an error that does not show it", err)
	}
}

// TestAcquireImageReportsPulling: a container run's image comes with its
// tenant's login, its pull is reported as pulling facts from 0 to the
// whole, a cache hit reports nothing, and a refusal has its reason.
func TestAcquireImageReportsPulling(t *testing.T) {
	b := newImageBed(t)
	img, err := random.Image(1<<20, 4) // 4 MiB of random bytes: no compression shrinks it
	if err != nil {
		t.Fatal(err)
	}
	digest := b.push(t, "team/train:1", img)
	b.storeLogin(t, "acme", loginJSON(t, "acme", map[string]contracts.RegistryAuth{b.reg: {Username: "alice", Password: alicePassword}}))

	var mu sync.Mutex
	var pulling []contracts.RunEvent
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = b.admin.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamRuns, FilterSubjects: []string{contracts.SubjectRuns(imageTestNode)}},
			func(_ context.Context, m *bus.Msg) error {
				var ev contracts.RunEvent
				if err := m.Decode(&ev); err != nil {
					t.Errorf("run fact: %v", err)
				}
				mu.Lock()
				pulling = append(pulling, ev)
				mu.Unlock()
				return nil
			}, nil)
	}()
	t.Cleanup(func() { cancel(); <-done })

	alloc := func(id, tenant, ref string) contracts.Allocation {
		return contracts.Allocation{ID: id, Tenant: tenant, JobID: "job-" + id, Attempt: 1, NodeID: imageTestNode,
			Run: contracts.RunSpec{Image: ref}}
	}
	ref := b.reg + "/team/train:1"
	got, release, err := b.agent.acquireImage(context.Background(), alloc("a1", "acme", ref))
	if err != nil {
		t.Fatalf("acquireImage: %v", err)
	}
	defer release()
	if got.Digest != digest || got.Lease == "" || got.RootFS == "" || got.Ref != ref {
		t.Errorf("acquireImage = %+v; want digest %s, a lease, a root", got, digest)
	}
	var reports []contracts.PullProgress
	eventuallyTrue(t, "the last pulling fact", func() bool {
		mu.Lock()
		defer mu.Unlock()
		reports = reports[:0]
		for _, ev := range pulling {
			if ev.Kind != contracts.RunPulling || ev.AllocationID != "a1" || ev.Pull == nil {
				t.Fatalf("unexpected run fact %+v", ev)
			}
			reports = append(reports, *ev.Pull)
		}
		return len(reports) > 0 && reports[len(reports)-1].Done == reports[len(reports)-1].Total
	})
	if first := reports[0]; first.Done != 0 || first.Total < 4<<20 || first.Image != ref {
		t.Errorf("first report %+v; want 0 of the image's 4 MiB and more", first)
	}
	if len(reports) < 3 || len(reports) > 12 {
		t.Errorf("%d pulling facts; want the start, the end and about every tenth between", len(reports))
	}
	for i := 1; i < len(reports); i++ {
		if reports[i].Done < reports[i-1].Done {
			t.Errorf("progress went backwards: %+v", reports)
		}
	}

	// A cache hit: no pulling fact.
	n := len(reports)
	_, release2, err := b.agent.acquireImage(context.Background(), alloc("a2", "acme", ref))
	if err != nil {
		t.Fatal(err)
	}
	release2()
	if got := b.agent.images.inventory(); len(got) != 3 || got[0] != digest {
		t.Errorf("inventory images %v; want the digest first, then its two references", got)
	}

	for name, tt := range map[string]struct {
		tenant, ref string
		want        contracts.Reason
	}{
		"no login":  {"other", ref, contracts.ReasonImageUnauthorized},
		"no image":  {"acme", b.reg + "/team/nothing:1", contracts.ReasonImageNotFound},
		"bad ref":   {"acme", "Bad Ref", contracts.ReasonImageInvalid},
		"no answer": {"acme", "127.0.0.1:1/team/train:1", contracts.ReasonImagePullFailed},
	} {
		_, _, err := b.agent.acquireImage(context.Background(), alloc("x-"+strings.ReplaceAll(name, " ", "-"), tt.tenant, tt.ref))
		if got := imageReason(err); err == nil || got != tt.want {
			t.Errorf("%s: acquireImage error %v, reason %s; want %s", name, err, got, tt.want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(pulling) != n {
		t.Errorf("%d run facts after a cache hit and failures; want the %d of the first pull", len(pulling), n)
	}
}

func eventuallyTrue(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within 30 s: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestImageCacheFlags(t *testing.T) {
	c := DefaultConfig()
	c.NodeID = "img-07"
	fs := flag.NewFlagSet("node-agent", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"-image-dir", "/var/lib/gpuplane/images", "-image-cache-bytes", "107374182400"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.ImageDir != "/var/lib/gpuplane/images" || c.ImageCacheMaxBytes != 100<<30 {
		t.Errorf("image dir %q, limit %d; want the flags'", c.ImageDir, c.ImageCacheMaxBytes)
	}
	c.ImageCacheMaxBytes = -1
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "image cache limit") {
		t.Errorf("Validate with a negative image cache limit: %v", err)
	}
}

// TestPullSlotsBoundTheReferencesPulledAtOnce: at most
// MaxConcurrentPulls references are acquired at once; runs of a
// reference already pulling share its slot, and a slot given back by the
// last run of its reference lets another reference in. A waiter whose
// ctx ends gives up.
func TestPullSlotsBoundTheReferencesPulledAtOnce(t *testing.T) {
	var p pullSlots
	ctx := context.Background()
	gone, cancel := context.WithCancel(ctx)
	cancel() // a waiter that would have to wait gives up at once
	var releases []func()
	for i := range MaxConcurrentPulls {
		r, err := p.acquire(ctx, fmt.Sprintf("registry.example/app:%d", i))
		if err != nil {
			t.Fatal(err)
		}
		releases = append(releases, r)
	}
	tests := []struct {
		name    string
		ref     string
		release int // the slot given back first, -1 for none
		wantErr bool
	}{
		{"another reference waits", "registry.example/other:1", -1, true},
		{"a reference pulling shares its slot", "registry.example/app:0", -1, false},
		{"a slot its last run gave back is free", "registry.example/other:1", 1, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.release >= 0 {
				releases[tt.release]()
				releases[tt.release]() // once only: a second call gives back nothing more
			}
			r, err := p.acquire(gone, tt.ref)
			if (err != nil) != tt.wantErr {
				t.Fatalf("acquire %s: %v, want error %v", tt.ref, err, tt.wantErr)
			}
			if err == nil {
				releases = append(releases, r) // held until the test ends
			}
		})
	}
	// app:0 has two runs: the first one's release keeps the slot.
	releases[0]()
	if _, err := p.acquire(gone, "registry.example/third:1"); err == nil {
		t.Fatal("a slot was given back while a run of its reference still held it")
	}
}
