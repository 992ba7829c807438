package billing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/kvsnap"
	"github.com/gpuplane/gpuplane/services/billing/internal/biller"
)

// Billing's start from a checkpoint (issue 17: nothing grows with
// history; internal/biller/checkpoint.go says what one holds and why it is
// a start's state). Every replica folds USAGE in order beside its work
// and writes the fold now and then to contracts.BucketSnapshots; a start
// restores the newest and replays USAGE only after it. USAGE stays the
// truth: a checkpoint missing, unreadable, of another schema, of another
// life of USAGE or ahead of it, or one whose forgetting the store's
// generation no longer holds, is ignored and USAGE is replayed whole.

// checkpointStore is billing's checkpoint in kv. Every replica writes the
// same keys, each a fold of the same stream, so any replica's is a start's
// state; one behind another's only costs its start a longer tail, and a
// fold writes only once it has caught up with USAGE. (Not CompareAndSet: a
// write that forgot more at the same sequence must land.) Two writing at
// once can leave a head whose checksum fails: the next start reads USAGE
// whole.
func checkpointStore(kv jetstream.KeyValue) kvsnap.Store {
	// Written whole (no Parts): parts pay with one writer, and a
	// checkpoint is small (what is billed and not settled).
	return kvsnap.Store{KV: kv, HeadKey: contracts.BillingSnapshotHeadKey(), ChunkKey: contracts.BillingSnapshotChunkKey}
}

// checkpointFile is what is stored: the fold's state and the life of
// USAGE it was read from.
type checkpointFile struct {
	Created string          `json:"created"`
	State   json.RawMessage `json:"state"`
}

// generation is what a start asks the store: its content's generation
// (Store.Open).
type generation interface {
	Open(ctx context.Context) (string, error)
}

// startBiller returns a biller holding what USAGE holds: restored from the
// checkpoint and the records after it when one fits, else replayed whole;
// and the checkpoint used (nil when none).
func startBiller(ctx context.Context, b *bus.Bus, kv jetstream.KeyValue, cfg biller.Config, gen generation,
	log *slog.Logger) (*biller.Biller, *checkpointFile, error) {
	if bl, f, why := loadCheckpoint(ctx, b, kv, cfg, gen); why == nil {
		seq := bl.Seq()
		err := bl.ReplayFrom(ctx, seq)
		if err == nil {
			log.Info("billing started from its checkpoint", "checkpoint_seq", seq, "usage_seq", bl.Seq())
			return bl, f, nil
		}
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		log.Warn("billing checkpoint not usable; reading USAGE whole", "err", err)
	} else if !errors.Is(why, kvsnap.ErrNone) {
		log.Info("billing checkpoint not used; reading USAGE whole", "why", why)
	}
	bl := biller.New(cfg)
	if err := bl.Rebuild(ctx); err != nil {
		return nil, nil, err
	}
	return bl, nil, nil
}

// loadCheckpoint reads and restores the checkpoint, or says why it does
// not fit.
func loadCheckpoint(ctx context.Context, b *bus.Bus, kv jetstream.KeyValue, cfg biller.Config,
	gen generation) (bl *biller.Biller, f *checkpointFile, why error) {
	data, _, err := checkpointStore(kv).Read(ctx)
	if err != nil {
		return nil, nil, err
	}
	f = &checkpointFile{}
	if err := json.Unmarshal(data, f); err != nil {
		return nil, nil, fmt.Errorf("%w: %w", kvsnap.ErrBad, err)
	}
	bl, seq, needs, err := biller.Restore(cfg, f.State)
	if err != nil {
		return nil, nil, err
	}
	lives, err := kvsnap.Lives(ctx, b.JetStream(), contracts.StreamUsage)
	if err != nil {
		return nil, nil, err
	}
	if err := kvsnap.Stale(contracts.StreamUsage, lives[contracts.StreamUsage], f.Created, seq); err != nil {
		return nil, nil, err
	}
	if needs != "" {
		// What the fold forgot, the store confirmed in generation needs:
		// another generation may not hold it yet.
		g, err := gen.Open(ctx)
		if err != nil || g != needs {
			return nil, nil, fmt.Errorf("the checkpoint forgot what the store's generation %q confirmed; the store is at %q (%v)",
				needs, g, err)
		}
	}
	return bl, f, nil
}

// checkpoints folds USAGE, from the checkpoint the start used (or from
// its first record), forgets as the serving biller does, and writes the
// fold every interval it moved once it has caught up, until ctx ends; it
// returns once its goroutines have. It never fails billing: without
// checkpoints a start reads USAGE whole, as before.
func checkpoints(ctx context.Context, b *bus.Bus, kv jetstream.KeyValue, cfg biller.Config, from *checkpointFile,
	interval, forgetEvery time.Duration, log *slog.Logger) {
	fold, created := biller.New(cfg), ""
	if from != nil {
		var err error
		if fold, _, _, err = biller.Restore(cfg, from.State); err != nil {
			log.Warn("billing checkpoints off: the checkpoint the start used does not restore", "err", err)
			return
		}
		created = from.Created
	}
	for created == "" { // the life of USAGE the fold reads, before it reads
		var err error
		if created, err = usageCreated(ctx, b); err == nil {
			break
		}
		log.Warn("billing checkpoints wait for USAGE", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval):
		}
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		forgetLogged(ctx, fold, forgetEvery, log, "checkpoint fold forgot billed allocations the store holds")
	})
	var caughtUp atomic.Bool
	wg.Go(func() {
		for {
			err := b.Follow(ctx, bus.FollowSpec{Stream: contracts.StreamUsage, FilterSubjects: []string{contracts.SubjectUsageAll},
				StartSeq: fold.Seq() + 1}, fold.ApplyFolded, func() { caughtUp.Store(true) })
			if ctx.Err() != nil {
				return
			}
			log.Warn("billing checkpoint fold stopped reading USAGE; reading on", "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(interval):
			}
		}
	})
	store := checkpointStore(kv)
	written, forgets := fold.Seq(), fold.Forgets()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if recalled, err := fold.RecallIfStale(ctx); recalled && err != nil {
			// Its checkpoints still name the old generation: no start
			// uses them until a recall succeeds.
			log.Warn("billing checkpoint fold could not read USAGE back for the store's new generation", "err", err)
		} else if recalled {
			log.Info("billing checkpoint fold read USAGE back: the store is in a new generation")
		}
		seq, f := fold.Seq(), fold.Forgets()
		if !caughtUp.Load() || seq <= written && f == forgets {
			continue
		}
		_, err := store.Write(ctx, seq, func() ([]byte, error) {
			state, _, err := fold.Checkpoint()
			if err != nil {
				return nil, err
			}
			return marshalCheckpoint(created, state)
		})
		switch {
		case err == nil:
			log.Debug("billing checkpoint written", "usage_seq", seq)
		case ctx.Err() == nil:
			log.Warn("billing checkpoint not written", "err", err)
			continue
		}
		written, forgets = seq, f
	}
}

// usageCreated is the life of USAGE a checkpoint is read from.
func usageCreated(ctx context.Context, b *bus.Bus) (string, error) {
	lives, err := kvsnap.Lives(ctx, b.JetStream(), contracts.StreamUsage)
	if err != nil {
		return "", err
	}
	return lives[contracts.StreamUsage].Created, nil
}

// marshalCheckpoint is what is stored of a fold's state (Checkpoint's).
func marshalCheckpoint(created string, state []byte) ([]byte, error) {
	return json.Marshal(checkpointFile{Created: created, State: state})
}
