package bus

import (
	"context"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// KeyValue returns the platform KV bucket named bucket (one of
// contracts.KeyValues), creating or updating it first: like the streams,
// every service that uses a bucket provisions it, so any can start first.
func (b *Bus) KeyValue(ctx context.Context, bucket string) (jetstream.KeyValue, error) {
	for _, cfg := range contracts.KeyValues(b.opts) {
		if cfg.Bucket != bucket {
			continue
		}
		var kv jetstream.KeyValue
		if err := retry(ctx, func() error {
			var err error
			kv, err = b.js.CreateOrUpdateKeyValue(ctx, cfg)
			return err
		}); err != nil {
			return nil, fmt.Errorf("bus: kv bucket %s: %w", bucket, err)
		}
		return kv, nil
	}
	return nil, fmt.Errorf("bus: %q is not a platform KV bucket", bucket)
}
