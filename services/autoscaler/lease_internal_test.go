package autoscaler

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
)

type termAt struct{ valid bool }

func (t *termAt) Valid() bool { return t.valid }

// A leader frozen past its lease calls nothing that changes the fleet
// when it thaws, even before its context is cancelled.
func TestFencedProviderRefusesAfterTheTerm(t *testing.T) {
	sim, err := simcloud.New(simcloud.Config{Now: time.Now})
	if err != nil {
		t.Fatal(err)
	}
	term := &termAt{valid: true}
	p := fencedProvider{Provider: sim, term: term}
	ctx := context.Background()
	req := cloud.CreateRequest{Pool: "h100", MachineType: "a3-highgpu-8g", PriceClass: cloud.OnDemand, Token: "t1"}
	m, err := p.Create(ctx, req)
	if err != nil {
		t.Fatalf("create while leading: %v", err)
	}
	term.valid = false
	req.Token = "t2"
	if _, err := p.Create(ctx, req); !errors.Is(err, errNotLeader) {
		t.Fatalf("create after the term: %v, want errNotLeader", err)
	}
	if err := p.Delete(ctx, m.ID); !errors.Is(err, errNotLeader) {
		t.Fatalf("delete after the term: %v, want errNotLeader", err)
	}
	if ms := sim.Machines(); len(ms) != 1 || ms[0].State == cloud.Deleted {
		t.Fatalf("provider machines %+v; want the one created while leading, not deleted", ms)
	}
	if _, err := p.List(ctx, "h100"); err != nil {
		t.Fatalf("list after the term: %v (listing changes nothing)", err)
	}
}
