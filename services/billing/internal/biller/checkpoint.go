package biller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Checkpoints (issue 17: nothing grows with history). A start used to
// replay USAGE from its first record, so a restart took longer every day
// the platform ran. A checkpoint is what a biller that replayed USAGE up
// to a sequence holds, less what it forgot (forget.go): the allocations it
// keeps whole (billed in part, provisional, voided), the settled digests
// the store has not confirmed yet, the last sequence of each tenant's
// usage subject, the end of the latest segment, and the store generation
// that confirmed what was forgotten. A start restores it and replays USAGE
// only after its sequence.
//
// Why that is a start's state: a checkpoint is written from a fold, a
// biller that bills nothing and reads USAGE in order (ApplyFolded), so it
// holds exactly what a replay up to its sequence holds, every replica's
// records included; a serving biller's own state is not that (it learns
// another replica's records of a subject only when it bills there). What
// the fold forgot, the index confirmed billed in generation Forgot; a
// biller restored from it has forgotten the same in the same generation,
// which is what Forget leaves behind, and find and recall already answer
// for it. So a checkpoint is only used while the store's generation is
// still Forgot (a start checks); otherwise USAGE is replayed whole, as
// before.

// checkpointSchema is the version of the encoding and of the rules above.
const checkpointSchema = 1

// checkpoint is the encoded state.
type checkpoint struct {
	Schema int `json:"schema"`
	// Seq is the last USAGE sequence folded.
	Seq uint64 `json:"seq"`
	// Forgot is the store generation that confirmed every allocation the
	// fold forgot ("": it forgot none).
	Forgot  string                  `json:"forgot,omitempty"`
	Allocs  map[string]allocationCP `json:"allocs,omitempty"`
	Settled []epochCP               `json:"settled,omitempty"`
	Last    map[string]uint64       `json:"last,omitempty"`
	Until   time.Time               `json:"until"`
	Round   int                     `json:"round,omitempty"`
}

type allocationCP struct {
	Next        int                     `json:"next"`
	Until       time.Time               `json:"until"`
	Final       bool                    `json:"final,omitempty"`
	Provisional bool                    `json:"provisional,omitempty"`
	Open        []contracts.UsageRecord `json:"open,omitempty"`
	Voiding     bool                    `json:"voiding,omitempty"`
}

// epochCP is an epoch: its digests one after the other, and the indexes
// of those whose allocation has voids.
type epochCP struct {
	Keys    []byte `json:"keys"`
	Voiding []int  `json:"voiding,omitempty"`
	Closed  int    `json:"closed,omitempty"`
}

// ApplyFolded folds one USAGE message into b, a fold: a biller that
// bills nothing and reads USAGE in order (bus.Follow), for checkpoints.
func (b *Biller) ApplyFolded(ctx context.Context, m *bus.Msg) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.apply(ctx, m)
}

// Seq is the last USAGE sequence b replayed or folded.
func (b *Biller) Seq() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.seq
}

// Forgets counts the changes to what b forgot (an epoch forgotten, a
// recall): a fold whose USAGE did not move still has a new checkpoint to
// write when it did.
func (b *Biller) Forgets() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.forgets
}

// RecallIfStale reads USAGE back into b, a fold, when the store's
// generation is not the one b forgot in (Redis restarted or flushed): a
// serving biller does that at its next question to the store (find), and
// a fold asks none, so it would forget nothing more, and its checkpoints
// would name a generation no start can use, until the process ends.
func (b *Biller) RecallIfStale(ctx context.Context) (bool, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.forgot == "" || b.cfg.Index == nil {
		return false, nil
	}
	gen, _, err := b.cfg.Index.Billed(ctx, nil)
	if err != nil || gen == "" || gen == b.forgot {
		return false, nil // no answer: the next round asks again
	}
	return true, b.recall(ctx)
}

// Checkpoint encodes what b holds (a fold's state) and the USAGE sequence
// it covers.
func (b *Biller) Checkpoint() ([]byte, uint64, error) {
	b.mu.Lock()
	cp := checkpoint{Schema: checkpointSchema, Seq: b.seq, Forgot: b.forgot, Last: b.last, Until: b.until,
		Round: b.round, Allocs: make(map[string]allocationCP, len(b.allocs))}
	for id, st := range b.allocs {
		cp.Allocs[id] = allocationCP{Next: st.next, Until: st.until, Final: st.final, Provisional: st.provisional,
			Open: st.open, Voiding: st.voiding}
	}
	for _, e := range b.settled {
		ec := epochCP{Keys: make([]byte, 0, 16*len(e.keys)), Closed: e.closed}
		for k, s := range e.keys {
			if s.voiding {
				ec.Voiding = append(ec.Voiding, len(ec.Keys)/16)
			}
			ec.Keys = append(ec.Keys, k[:]...)
		}
		cp.Settled = append(cp.Settled, ec)
	}
	data, err := json.Marshal(cp) // under b.mu: the maps are b's own
	b.mu.Unlock()
	if err != nil {
		return nil, 0, fmt.Errorf("encode billing checkpoint: %w", err)
	}
	return data, cp.Seq, nil
}

// ErrCheckpoint is a checkpoint that cannot be restored.
var ErrCheckpoint = errors.New("billing checkpoint unusable")

// Restore returns a biller holding what data (Checkpoint's) says, with the
// USAGE sequence it covers and the store generation it needs (Forgot; ""
// when any will do).
func Restore(cfg Config, data []byte) (b *Biller, seq uint64, needs string, err error) {
	var cp checkpoint
	if err := json.Unmarshal(data, &cp); err != nil {
		return nil, 0, "", fmt.Errorf("%w: %w", ErrCheckpoint, err)
	}
	if cp.Schema != checkpointSchema {
		return nil, 0, "", fmt.Errorf("%w: schema %d, want %d", ErrCheckpoint, cp.Schema, checkpointSchema)
	}
	b = New(cfg)
	b.seq, b.forgot, b.until, b.round = cp.Seq, cp.Forgot, cp.Until, cp.Round
	if cp.Last != nil {
		b.last = cp.Last
	}
	for id, a := range cp.Allocs {
		b.allocs[id] = &allocation{next: a.Next, until: a.Until, final: a.Final, provisional: a.Provisional,
			open: a.Open, voiding: a.Voiding}
	}
	if len(cp.Settled) > 0 {
		b.settled = b.settled[:0]
		for _, ec := range cp.Settled {
			if len(ec.Keys)%16 != 0 {
				return nil, 0, "", fmt.Errorf("%w: settled digests of %d bytes", ErrCheckpoint, len(ec.Keys))
			}
			e := newEpoch()
			e.closed = ec.Closed
			for i := 0; i < len(ec.Keys); i += 16 {
				e.keys[Key(ec.Keys[i:i+16])] = settledState{}
			}
			for _, i := range ec.Voiding {
				if i < 0 || 16*i >= len(ec.Keys) {
					return nil, 0, "", fmt.Errorf("%w: voiding digest %d of %d", ErrCheckpoint, i, len(ec.Keys)/16)
				}
				e.keys[Key(ec.Keys[16*i:16*i+16])] = settledState{voiding: true}
			}
			b.settled = append(b.settled, e)
		}
	}
	return b, cp.Seq, cp.Forgot, nil
}

// ReplayFrom replays the USAGE records after seq into what b holds: a
// start from a checkpoint (Rebuild replays them all).
func (b *Biller) ReplayFrom(ctx context.Context, seq uint64) error {
	if _, err := b.cfg.Bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage,
		FilterSubjects: []string{contracts.SubjectUsageAll}, StartSeq: seq + 1}, b.apply); err != nil {
		return fmt.Errorf("replay usage after %d: %w", seq, err)
	}
	return nil
}
