package bus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

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
		// One bound per call, as for streams (EnsureStreams).
		if err := retryEach(ctx, func(ctx context.Context) error {
			var err error
			if b.mode == ProvisionUpdate {
				kv, err = b.operatorKV(ctx, cfg)
				return err
			}
			// A service opens the bucket, creating it when missing; only
			// the operator updates a bucket's config.
			kv, err = b.js.KeyValue(ctx, bucket)
			if errors.Is(err, jetstream.ErrBucketNotFound) {
				kv, err = b.js.CreateKeyValue(ctx, cfg)
				if errors.Is(err, jetstream.ErrBucketExists) || errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
					kv, err = b.js.KeyValue(ctx, bucket)
				}
			}
			return err
		}); err != nil {
			return nil, fmt.Errorf("bus: kv bucket %s: %w", bucket, err)
		}
		return kv, nil
	}
	return nil, fmt.Errorf("bus: %q is not a platform KV bucket", bucket)
}

// operatorKV opens the bucket of cfg for the operator: created when
// missing, updated only when its backing stream drifted from what
// nats.go makes of cfg (drift.go says why not every time). The stream is
// read, not the bucket: a stream edited by hand (say, to unlimited
// history) is no valid bucket to nats.go, and the operator must still put
// it back.
func (b *Bus) operatorKV(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	if cfg.Mirror != nil || len(cfg.Sources) > 0 {
		return b.js.CreateOrUpdateKeyValue(ctx, cfg)
	}
	want := kvStream(cfg)
	s, err := b.js.Stream(ctx, want.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		kv, err := b.js.CreateKeyValue(ctx, cfg)
		if !errors.Is(err, jetstream.ErrBucketExists) && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return kv, err
		}
		// Another service created it first: compare what it made.
		s, err = b.js.Stream(ctx, want.Name)
	}
	if err != nil {
		return nil, err
	}
	if drift := streamDrift(want, s.CachedInfo().Config); len(drift) > 0 {
		b.log.Info("updating kv bucket to its contract", "bucket", cfg.Bucket, "fields", strings.Join(drift, ","))
		return b.js.UpdateKeyValue(ctx, cfg)
	}
	return b.js.KeyValue(ctx, cfg.Bucket)
}

// WatchKV follows every key of the platform bucket until ctx ends: apply
// gets each put or delete, in order, from one goroutine; ready is called
// once, after the values present at start were applied, so a service can
// hold back work that must not run blind. A broken watch is resumed with
// a backoff (it replays the current values, which apply must accept
// again). It returns nil when ctx ends.
func (b *Bus) WatchKV(ctx context.Context, bucket string, apply func(jetstream.KeyValueEntry), ready func()) error {
	kv, err := b.KeyValue(ctx, bucket)
	if err != nil {
		return err
	}
	var once sync.Once
	delay := 100 * time.Millisecond
	for {
		err := watchKVOnce(ctx, kv, apply, func() { once.Do(ready) })
		if ctx.Err() != nil {
			return nil
		}
		b.log.Warn("kv watch interrupted; resuming", "bucket", bucket, "err", err, "after", delay)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

func watchKVOnce(ctx context.Context, kv jetstream.KeyValue, apply func(jetstream.KeyValueEntry), ready func()) error {
	w, err := kv.WatchAll(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = w.Stop() }()
	for {
		select {
		case <-ctx.Done():
			return nil
		case e, ok := <-w.Updates():
			if !ok {
				return errors.New("watch closed")
			}
			if e == nil { // the initial values are all in
				ready()
				continue
			}
			apply(e)
		}
	}
}
