package simcloud_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/services/autoscaler/cloud"
	"github.com/gpuplane/gpuplane/services/autoscaler/simcloud"
)

type clock struct{ now time.Time }

func (c *clock) Now() time.Time { return c.now }

func TestProvider(t *testing.T) {
	ctx := context.Background()
	clk := &clock{now: time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)}
	var events []string
	p, err := simcloud.New(simcloud.Config{Now: clk.Now, ProvisionDelay: 90 * time.Second,
		Capacity: map[string]int{"a3-highgpu-8g": 2}, Quota: 3,
		Hooks: simcloud.Hooks{
			Up:   func(m cloud.Machine) { events = append(events, "up "+m.ID) },
			Down: func(m cloud.Machine) { events = append(events, "down "+m.ID) },
			Notice: func(m cloud.Machine) {
				events = append(events, "notice "+m.ID+" "+m.Interruption.Format(time.TimeOnly))
			},
		}})
	if err != nil {
		t.Fatal(err)
	}
	req := func(tok, typ string) cloud.CreateRequest {
		return cloud.CreateRequest{Token: tok, Pool: "h100", MachineType: typ, PriceClass: cloud.Spot}
	}
	m1, err := p.Create(ctx, req("t1", "a3-highgpu-8g"))
	if err != nil {
		t.Fatal(err)
	}
	// Same token, same machine, even after a lost reply.
	p.LoseReplies(1)
	if _, err := p.Create(ctx, req("t1", "a3-highgpu-8g")); !errors.Is(err, simcloud.ErrUnavailable) {
		t.Fatalf("lost reply: err %v", err)
	}
	again, err := p.Create(ctx, req("t1", "a3-highgpu-8g"))
	if err != nil || again.ID != m1.ID {
		t.Fatalf("same token: %v %v, want machine %s", again.ID, err, m1.ID)
	}
	if _, err := p.Create(ctx, req("t2", "a3-highgpu-8g")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Create(ctx, req("t3", "a3-highgpu-8g")); !errors.Is(err, cloud.ErrCapacity) {
		t.Errorf("third of a type capped at 2: err %v, want ErrCapacity", err)
	}
	if _, err := p.Create(ctx, req("t4", "g2-standard-8")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Create(ctx, req("t5", "g2-standard-8")); !errors.Is(err, cloud.ErrQuota) {
		t.Errorf("fourth machine with quota 3: err %v, want ErrQuota", err)
	}

	clk.now = clk.now.Add(89 * time.Second)
	if n := p.Advance(); n != 0 {
		t.Errorf("before the provisioning delay: %d transitions", n)
	}
	clk.now = clk.now.Add(time.Second)
	p.Advance()
	if err := p.Interrupt("h100-1"); err != nil {
		t.Fatal(err)
	}
	clk.now = clk.now.Add(simcloud.NoticeAhead)
	p.Advance()
	if err := p.Delete(ctx, "h100-2"); err != nil {
		t.Fatal(err)
	}
	want := []string{"up h100-1", "up h100-2", "up h100-3", "notice h100-1 12:03:30", "down h100-1", "down h100-2"}
	if diff := cmp.Diff(want, events); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	live, err := p.List(ctx, "h100")
	if err != nil || len(live) != 1 || live[0].ID != "h100-3" {
		t.Errorf("List = %+v, %v; want h100-3 only", live, err)
	}
	// A reclaimed machine's token still names it: no second machine.
	if m, err := p.Create(ctx, req("t1", "a3-highgpu-8g")); err != nil || m.ID != "h100-1" || m.State != cloud.Deleted {
		t.Errorf("token of a reclaimed machine: %+v, %v", m, err)
	}
	p.SetFailing(true, nil)
	if _, err := p.List(ctx, "h100"); !errors.Is(err, simcloud.ErrUnavailable) {
		t.Errorf("failing provider: err %v", err)
	}
	if err := p.Interrupt("h100-2"); !errors.Is(err, cloud.ErrNotFound) {
		t.Errorf("interrupting deleted h100-2: err %v, want ErrNotFound", err)
	}
}
