package bus_test

import (
	"context"
	"testing"

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
