package bus_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// TestConcurrentProvisioningOnAFreshCluster (issue 13, finding 1): every
// service starting at once on a fresh 3-member cluster provisions the
// streams and the buckets it uses at R3, and all of them come up within
// their connect deadline. Before, each stream's calls ran under the one
// 30 s connect context: a create request whose answer was lost in the
// meta leader's queue waited out the whole deadline, and every service
// exited with "context deadline exceeded".
func TestConcurrentProvisioningOnAFreshCluster(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	roles := []contracts.BusRole{contracts.BusScheduler, contracts.BusResourceManager, contracts.BusMonitor,
		contracts.BusAutoscaler, contracts.BusBilling, contracts.BusGateway}
	opts := contracts.StreamOptions{Replicas: 3}
	const deadline = 30 * time.Second

	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, 2*len(roles))
	for _, role := range roles {
		creds := natstest.Service(t, c, role)
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), deadline)
			defer cancel()
			b, err := bus.Connect(ctx, bus.Config{URL: c.URLs(), Name: string(role), CredsFile: creds,
				Streams: opts, ConnectTimeout: deadline})
			if err != nil {
				errs <- err
				return
			}
			defer b.Close(context.Background())
			for _, ba := range contracts.Buckets {
				if !slices.Contains(ba.Readers, role) && !slices.Contains(ba.Writers, role) {
					continue
				}
				if _, err := b.KeyValue(ctx, ba.Bucket); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("provisioning: %v", err)
	}
	// Not asserted: the bound is the deadline itself.
	t.Logf("%d services provisioned %d streams at R3 in %s", len(roles), len(contracts.Streams(opts)), time.Since(start))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	op, err := bus.Connect(ctx, bus.Config{URL: c.URLs(), Name: "operator", CredsFile: natstest.Operator(t, c),
		SkipProvision: true})
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close(context.Background())
	for _, sc := range contracts.Streams(opts) {
		s, err := op.JetStream().Stream(ctx, sc.Name)
		if err != nil {
			t.Errorf("stream %s: %v", sc.Name, err)
			continue
		}
		if r := s.CachedInfo().Config.Replicas; r != 3 {
			t.Errorf("stream %s has %d replicas, want 3", sc.Name, r)
		}
	}
	for _, kv := range contracts.KeyValues(opts) {
		s, err := op.JetStream().Stream(ctx, "KV_"+kv.Bucket)
		if err != nil {
			t.Errorf("bucket %s: %v", kv.Bucket, err)
			continue
		}
		if r := s.CachedInfo().Config.Replicas; r != 3 {
			t.Errorf("bucket %s has %d replicas, want 3", kv.Bucket, r)
		}
	}
}
