package nodeagent_test

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/oci/ocitest"
)

// TestInventoryListsCachedImages: an agent that starts on the image cache
// an earlier agent left reports its images (the scheduler's locality
// score): each by digest and by the references it was pulled as.
func TestInventoryListsCachedImages(t *testing.T) {
	rs := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(rs.Close)
	img, err := random.Image(1024, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref := strings.TrimPrefix(rs.URL, "http://") + "/team/infer:v2"
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	// What the earlier agent pulled.
	cfg := testConfig(t, "img-inv")
	cfg.ImageDir = t.TempDir()
	c, err := image.New(image.Config{Dir: cfg.ImageDir})
	if err != nil {
		t.Fatal(err)
	}
	if _, release, err := c.Acquire(context.Background(), ref, image.Auth{}, nil); err != nil {
		t.Fatal(err)
	} else {
		release()
	}
	c.Close()

	b := connect(t)
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(cfg.NodeID))
	startAgent(t, b, cfg)
	want := []string{d.String(), r.Context().Digest(d.String()).Name(), r.Name()}
	slices.Sort(want[1:])
	eventually(t, "an inventory with the cached image", func() bool {
		all := inv.all()
		return len(all) > 0 && slices.Equal(all[0].Images, want)
	})
}

// TestPullingFactsAreNotStarts: an agent that dies while it pulls a run's
// image has published pulling facts and no started fact; the next agent
// must still start the run when its commit is delivered again.
func TestPullingFactsAreNotStarts(t *testing.T) {
	b := connect(t)
	const node = "img-pull"
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	a := allocation(node, "pulled", contracts.RunSpec{Duration: contracts.Duration(200 * time.Millisecond)}, 0)
	// What the agent that died left on the stream.
	ev := contracts.RunEvent{SchemaVersion: contracts.SchemaVersion, Kind: contracts.RunPulling, AllocationID: a.ID,
		Tenant: a.Tenant, JobID: a.JobID, Attempt: a.Attempt, NodeID: node, Devices: a.Devices, Time: time.Now(),
		Pull: &contracts.PullProgress{Image: "registry.example/team/app:1", Done: 1 << 20, Total: 8 << 20}}
	if _, err := b.Publish(context.Background(), contracts.SubjectRuns(node), contracts.RunPullingID(a.ID, 0), ev); err != nil {
		t.Fatal(err)
	}
	startAgent(t, b, testConfig(t, node))
	ledger(t, b, contracts.LedgerCommitted, a, "")
	waitStarted(t, runs, a.ID)
	waitEnded(t, runs, a.ID)
}

// TestRestartedAgentKeepsARunningContainersImage: an agent killed while
// its container runs leaves the image held; the next agent, whose cache
// keeps nothing it need not (a limit of one byte), re-adopts the
// container and keeps its image through the pull and the end of another
// image's run, and lets it go once the container ends. The first pull is
// reported before the run starts, and the inventory then lists the image.
func TestRestartedAgentKeepsARunningContainersImage(t *testing.T) {
	rt := ocitest.Runtime(t)
	rs := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(rs.Close)
	host := strings.TrimPrefix(rs.URL, "http://")
	long := ocitest.OCIImage(t, ocitest.Image(t))
	short, err := mutate.AppendLayers(long, static.NewLayer(tarOf(t, "other", "another image\n"), types.OCIUncompressedLayer))
	if err != nil {
		t.Fatal(err)
	}
	digests := map[string]string{}
	for tag, img := range map[string]v1.Image{"long": long, "short": short} {
		r, err := name.ParseReference(host + "/acme/" + tag + ":1")
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Write(r, img); err != nil {
			t.Fatal(err)
		}
		d, err := img.Digest()
		if err != nil {
			t.Fatal(err)
		}
		digests[tag] = d.String()
	}
	b := connect(t)
	const node = "img-crash"
	cfg := testConfig(t, node)
	cfg.Runc = rt.Path
	runs := record[contracts.RunEvent](t, b, contracts.StreamRuns, contracts.SubjectRuns(node))
	inv := record[contracts.NodeInventory](t, b, contracts.StreamNodes, contracts.SubjectInventory(node))
	rootOf := func(tag string) string {
		return filepath.Join(cfg.LogDir, "images", "images", strings.TrimPrefix(digests[tag], "sha256:"), "rootfs")
	}

	crash := startHelperAgent(t, b, cfg)
	running := allocation(node, "long", contracts.RunSpec{Image: host + "/acme/long:1", Command: []string{"/bin/sleep", "60"}}, 0)
	ledger(t, b, contracts.LedgerCommitted, running, "")
	waitStarted(t, runs, running.ID)
	var kinds []contracts.RunKind
	for _, ev := range runs.all() {
		if ev.AllocationID == running.ID {
			kinds = append(kinds, ev.Kind)
		}
	}
	if len(kinds) < 3 || kinds[0] != contracts.RunPulling || kinds[len(kinds)-1] != contracts.RunStarted {
		t.Errorf("run facts %v; want pulling facts, then started", kinds)
	}
	eventually(t, "an inventory listing the pulled image", func() bool {
		all := inv.all()
		return len(all) > 0 && slices.Contains(all[len(all)-1].Images, digests["long"])
	})
	crash()

	cfg.ImageCacheMaxBytes = 1
	startAgentAfterCrash(t, b, cfg, inv, len(inv.all()))
	other := allocation(node, "short", contracts.RunSpec{Image: host + "/acme/short:1", Command: []string{"/bin/true"}}, 1)
	ledger(t, b, contracts.LedgerCommitted, other, "")
	if r := waitEnded(t, runs, other.ID).Result; r.Outcome != contracts.OutcomeSucceeded {
		t.Fatalf("the other image's run: %+v", r)
	}
	eventually(t, "the other image collected once its run ended", func() bool {
		_, err := os.Stat(rootOf("short"))
		return os.IsNotExist(err)
	})
	if _, err := os.Stat(filepath.Join(rootOf("long"), "bin", "sleep")); err != nil {
		t.Fatalf("the re-adopted container's image was collected while it runs: %v", err)
	}
	if _, ended := facts(runs, running.ID); len(ended) != 0 {
		t.Fatalf("the re-adopted container ended: %+v", ended[0])
	}

	stopRun(t, b, running, time.Second)
	waitEnded(t, runs, running.ID)
	eventually(t, "the image collected once its last run ended", func() bool {
		_, err := os.Stat(rootOf("long"))
		return os.IsNotExist(err)
	})
}

// tarOf is a tar of one file.
func tarOf(t *testing.T, name, body string) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write([]byte(body)); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
