package nodeagent_test

import (
	"context"
	"io"
	"log"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/node-agent/internal/image"
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
