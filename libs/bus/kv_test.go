package bus_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestKeyValueProvisionsPlatformBuckets(t *testing.T) {
	b := connect(t)
	ctx := context.Background()
	kv, err := b.KeyValue(ctx, contracts.BucketBudgets)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "acme", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	again, err := b.KeyValue(ctx, contracts.BucketBudgets)
	if err != nil {
		t.Fatal(err)
	}
	if e, err := again.Get(ctx, "acme"); err != nil || string(e.Value()) != `{}` {
		t.Errorf("a second KeyValue lost the bucket's content: %v", err)
	}
	if _, err := b.KeyValue(ctx, "not-ours"); err == nil {
		t.Error("an unknown bucket was created")
	}
}

// TestWatchKVReadyAfterTheInitialValues: ready comes once, after every
// value present at start was applied; later puts and deletes follow in
// order; the watch ends with ctx.
func TestWatchKVReadyAfterTheInitialValues(t *testing.T) {
	b := connect(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	kv, err := b.KeyValue(ctx, contracts.BucketBudgets)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c"} {
		if _, err := kv.Put(ctx, k, []byte(k)); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	var seen []string
	readyAt := -1
	readies := 0
	done := make(chan error, 1)
	go func() {
		done <- b.WatchKV(ctx, contracts.BucketBudgets, func(e jetstream.KeyValueEntry) {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, e.Operation().String()+":"+e.Key())
		}, func() {
			mu.Lock()
			defer mu.Unlock()
			readies++
			readyAt = len(seen)
		})
	}()
	eventually(t, 5*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return readies == 1 }, "ready")
	if _, err := kv.Put(ctx, "d", []byte("d")); err != nil {
		t.Fatal(err)
	}
	if err := kv.Delete(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) == 5 }, "the later changes")
	mu.Lock()
	want := []string{"KeyValuePutOp:a", "KeyValuePutOp:b", "KeyValuePutOp:c", "KeyValuePutOp:d", "KeyValueDeleteOp:a"}
	if readyAt != 3 || readies != 1 || strings.Join(seen, ",") != strings.Join(want, ",") {
		t.Errorf("ready after %d entries (%d times), seen %v; want ready once after 3, seen %v", readyAt, readies, seen, want)
	}
	mu.Unlock()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("WatchKV ended with %v, want nil when ctx ends", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("WatchKV did not end with ctx")
	}
}
