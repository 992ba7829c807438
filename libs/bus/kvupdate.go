package bus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// IsConflict reports whether err is a KV compare-and-set (Create, Update,
// or a Delete at a revision) that lost to another writer.
func IsConflict(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && (apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence ||
		apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant) {
		return true
	}
	return errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch)
}

// kvAttempts bounds the compare-and-set retries of UpdateKV.
const kvAttempts = 10

// UpdateKV changes key with compare-and-set, reading again and retrying
// when another writer got in between. change gets the current value (nil
// when the key does not exist) and returns the next one, nil to delete the
// key, and write false to leave it as it is.
func UpdateKV(ctx context.Context, kv jetstream.KeyValue, key string,
	change func(old []byte) (next []byte, write bool, err error)) error {
	var last error
	for range kvAttempts {
		var old []byte
		var rev uint64
		e, err := kv.Get(ctx, key)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
		case err != nil:
			return fmt.Errorf("read %s: %w", key, err)
		default:
			old, rev = e.Value(), e.Revision()
		}
		next, write, err := change(old)
		if err != nil || !write {
			return err
		}
		switch {
		case next == nil && rev == 0:
			return nil
		case next == nil:
			err = kv.Delete(ctx, key, jetstream.LastRevision(rev))
		case rev == 0:
			_, err = kv.Create(ctx, key, next)
		default:
			_, err = kv.Update(ctx, key, next, rev)
		}
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !IsConflict(err) {
			return fmt.Errorf("write %s: %w", key, err)
		}
		last = err
	}
	return fmt.Errorf("write %s: %d attempts lost to concurrent writers: %w", key, kvAttempts, last)
}

// ErrUnreadableHold: a node's hold document does not decode. Readers treat
// it as a cordon (fail closed); writers leave it for a person to fix.
var ErrUnreadableHold = errors.New("hold document is unreadable")

// UpdateNodeAdmin changes node's hold in contracts.BucketNodeAdmin with
// compare-and-set: change gets the current document (a fresh one for the
// node when it has none) and reports whether it changed it. Every writer
// (administrators, the autoscaler, the scheduler) changes only its own
// fields, so the others' holds survive; a document left holding nothing
// is deleted.
func UpdateNodeAdmin(ctx context.Context, kv jetstream.KeyValue, node string, now time.Time,
	change func(h *contracts.NodeAdmin) bool) error {
	return UpdateKV(ctx, kv, node, func(old []byte) ([]byte, bool, error) {
		h := contracts.NodeAdmin{SchemaVersion: contracts.SchemaVersion, NodeID: node}
		if old != nil {
			if err := json.Unmarshal(old, &h); err != nil {
				return nil, false, fmt.Errorf("%w: node %s: %v", ErrUnreadableHold, node, err)
			}
		}
		if !change(&h) {
			return nil, false, nil
		}
		if h.Empty() {
			return nil, true, nil
		}
		h.NodeID, h.Time = node, now.UTC()
		b, err := json.Marshal(h)
		return b, true, err
	})
}
