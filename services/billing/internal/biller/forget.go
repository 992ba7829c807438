package biller

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Forgetting (issue 17: nothing grows with history). A settled digest is
// 16 bytes and a map slot per job ever billed, for ever, because an input
// for an allocation billed long ago can always come again: a redelivered
// release or ended fact, a consumer created again (every message once
// more, at its old sequence), an ended fact the agent's publish stored
// twice (its first try landed, its ack was lost, and the retry got through
// after JetStream's 2-minute duplicate window: a copy at a new sequence,
// as late as the agent's partition was long), a dead letter republished.
// No sequence or time bounds them, so no window on the digests is safe.
//
// What bounds them instead is the store, which is fed from USAGE and
// marks each allocation it applies a record of (Index): "USAGE holds
// records of this allocation" is a fact about USAGE, and the store holds
// it in each generation of its content. So:
//
//   - Forget drops a closed epoch of settled digests once the index
//     answers, in one generation G, that every allocation of it is
//     billed. forgot = G.
//   - find, for an allocation the biller does not hold while forgot is
//     set, asks the index. Answered in G, not billed: no record of it was
//     ever applied, and every forgotten allocation was, so it is none of
//     them: billed as new (the compare-and-set on the tenant's subject
//     still catches a bill another replica published that the biller has
//     not read). Billed: the tenant's usage subject is read up to its
//     end; an allocation still unknown then is one the biller forgot,
//     settled (only settled ones are forgotten), and nothing is billed.
//   - ask puts that question for the allocations of a batch of
//     messages, in one round trip, before the batch is billed, outside
//     b.mu (the other consumer bills meanwhile). find takes its answer
//     for its own only if, under b.mu, it is of the generation forgot
//     names and nothing was forgotten or recalled since before it was
//     asked (forgets unchanged): then every allocation forgotten was
//     confirmed billed in that generation before the question, an
//     answer never goes from billed to not billed within one, and "not
//     billed" still means none of them. Otherwise find asks itself.
//   - No answer, or one of another generation (Redis restarted or was
//     flushed: its content is rebuilt from USAGE): recall reads USAGE
//     back for the allocations the biller does not hold, as a start
//     would, and nothing is forgotten for forgetHold. Metering never
//     waits on the store and never guesses.
//
// Only settled allocations are forgotten: whole ones (a bill in part, a
// provisional bill that an agent's end may void) stay.

// forgetHold is how long the biller keeps what it recalled before it
// forgets again: a store failing on and off would otherwise make it read
// USAGE again and again.
const forgetHold = time.Minute

// indexBatch bounds one question to the index.
const indexBatch = 4096

// keepRounds is how many Forget rounds an epoch stays after it closed:
// the other input of a run (the release after the agent's fact) usually
// comes within them, and is answered from memory rather than the store.
const keepRounds = 3

// maxClosed bounds the epochs waiting for the index: while it confirms
// nothing (Redis down), Forget stops closing epochs each round, so that
// lookups walk a few epochs, not one per round of the outage.
const maxClosed = 64

// Forget closes the open epoch and drops every closed epoch the index
// confirms, in one generation, and returns how many allocations it
// forgot. An epoch the index does not confirm whole (records not applied
// yet) is kept for the next call.
func (b *Biller) Forget(ctx context.Context) (int, error) {
	b.mu.Lock()
	if b.cfg.Index == nil || time.Now().Before(b.hold) {
		b.mu.Unlock()
		return 0, nil
	}
	b.round++
	if open := b.settled[len(b.settled)-1]; len(open.keys) > 0 && len(b.settled)-1 < maxClosed {
		open.closed = b.round
		b.settled = append(b.settled, newEpoch())
	}
	var closed []*epoch
	for _, e := range b.settled[:len(b.settled)-1] {
		if b.round-e.closed >= keepRounds {
			closed = append(closed, e)
		}
	}
	b.mu.Unlock()

	forgotten := 0
	for _, e := range closed {
		b.mu.Lock()
		keys := make([]Key, 0, len(e.keys))
		for k := range e.keys {
			keys = append(keys, k)
		}
		b.mu.Unlock()
		gen, ok := "", true // an epoch emptied meanwhile (its runs billed again) just goes
		if len(keys) > 0 {
			var err error
			if gen, ok, err = b.confirm(ctx, keys); err != nil {
				return forgotten, err
			}
		}
		if !ok {
			continue
		}
		b.mu.Lock()
		i := slices.Index(b.settled, e)
		// A generation other than the one the biller forgot in does not
		// hold what it forgot before: forget nothing more until a recall.
		if i >= 0 && i < len(b.settled)-1 && (gen == "" || b.forgot == "" || b.forgot == gen) {
			b.settled = slices.Delete(b.settled, i, i+1)
			b.forgets++
			if gen != "" {
				b.forgot = gen
			}
			forgotten += len(e.keys)
		}
		b.mu.Unlock()
	}
	return forgotten, nil
}

// confirm asks the index about keys; ok when it answers that every one is
// billed, in one generation.
func (b *Biller) confirm(ctx context.Context, keys []Key) (gen string, ok bool, err error) {
	for part := range slices.Chunk(keys, indexBatch) {
		g, billed, err := b.cfg.Index.Billed(ctx, part)
		if err != nil {
			return "", false, err
		}
		if (gen != "" && g != gen) || g == "" || len(billed) != len(part) || slices.Contains(billed, false) {
			return "", false, nil
		}
		gen = g
	}
	return gen, true, nil
}

// answers is what the index said, asked outside b.mu, of the
// allocations of a batch the biller did not hold (ask).
type answers struct {
	gen     string // the generation they are of
	forgets uint64 // b.forgets before they were asked
	billed  map[Key]bool
}

// ask puts the question find would put for each basis of bases (nil ones
// bill nothing) whose allocation the biller does not hold, in one round
// trip, outside b.mu; nil when none needs it or the index did not answer
// (find asks again, and reads USAGE back if need be). b.mu must not be
// held.
func (b *Biller) ask(ctx context.Context, bases []*basis) *answers {
	b.mu.Lock()
	if b.forgot == "" {
		b.mu.Unlock()
		return nil
	}
	ans := &answers{forgets: b.forgets, billed: map[Key]bool{}}
	var keys []Key
	for _, bs := range bases {
		if bs == nil {
			continue
		}
		id := bs.entry.Allocation.ID
		if st, _ := b.lookup(id); st != nil {
			continue
		}
		if k := KeyOf(id); !ans.asked(k) {
			keys = append(keys, k)
		}
	}
	b.mu.Unlock()
	if len(keys) == 0 {
		return nil
	}
	for part := range slices.Chunk(keys, indexBatch) {
		gen, billed, err := b.cfg.Index.Billed(ctx, part)
		if err != nil || gen == "" || (ans.gen != "" && gen != ans.gen) || len(billed) != len(part) {
			return nil
		}
		ans.gen = gen
		for i, k := range part {
			ans.billed[k] = billed[i]
		}
	}
	return ans
}

// asked reports whether k is asked already, and marks it asked.
func (ans *answers) asked(k Key) bool {
	if _, ok := ans.billed[k]; ok {
		return true
	}
	ans.billed[k] = false
	return false
}

// of is ans's answer for k, if it stands (see the top of this file).
// b.mu must be held.
func (ans *answers) of(b *Biller, k Key) (billed, ok bool) {
	if ans == nil || ans.forgets != b.forgets || ans.gen != b.forgot {
		return false, false
	}
	billed, ok = ans.billed[k]
	return billed, ok
}

// find is lookup, with what the biller forgot: an allocation it does not
// hold is asked about in the index (see the top of this file), unless
// ans answers for it. b.mu must be held.
func (b *Biller) find(ctx context.Context, id, tenant string, ans *answers) (st *allocation, settled bool, err error) {
	if st, settled := b.lookup(id); st != nil || b.forgot == "" {
		return st, settled, nil
	}
	billed, ok := ans.of(b, KeyOf(id))
	if !ok {
		gen, got, err := b.cfg.Index.Billed(ctx, []Key{KeyOf(id)})
		if err != nil || gen != b.forgot || len(got) != 1 {
			b.cfg.Log.Warn("the store cannot tell what billing forgot; reading USAGE back", "allocation_id", id,
				"forgotten_in", b.forgot, "store_generation", gen, "err", err)
			if err := b.recall(ctx); err != nil {
				return nil, false, err
			}
			st, settled := b.lookup(id)
			return st, settled, nil
		}
		billed = got[0]
	}
	if !billed {
		return nil, false, nil
	}
	if err := b.catchUp(ctx, contracts.SubjectUsage(tenant)); err != nil {
		return nil, false, err
	}
	if st, settled := b.lookup(id); st != nil {
		return st, settled, nil
	}
	return &allocation{final: true}, true, nil
}

// recall reads USAGE whole again into what the biller holds, for the
// allocations it does not hold now (those it forgot; what it holds is
// already all USAGE says of them), and holds off forgetting. b.mu must be
// held.
func (b *Biller) recall(ctx context.Context) error {
	// What the biller read of each subject before: a record past it may
	// be another replica's (or one whose publish ack was lost) of an
	// allocation this one holds, and must be read, not skipped, or a
	// redelivered input would bill the allocation again from a state
	// that misses it while b.last said it was read.
	read := maps.Clone(b.last)
	held := make(map[string]struct{}, len(b.allocs))
	for id := range b.allocs {
		held[id] = struct{}{}
	}
	before := slices.Clone(b.settled)
	b.settled = append(b.settled, newEpoch()) // what is recalled settles apart
	holds := func(id string) bool {
		if _, ok := held[id]; ok {
			return true
		}
		k := KeyOf(id)
		return slices.ContainsFunc(before, func(e *epoch) bool { _, ok := e.keys[k]; return ok })
	}
	n := 0
	if _, err := b.cfg.Bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamUsage,
		FilterSubjects: []string{contracts.SubjectUsageAll}}, func(_ context.Context, m *bus.Msg) error {
		// Read to here: a fold's apply skips it after (checkpoint.go).
		b.seq = max(b.seq, m.StreamSeq)
		var rec contracts.UsageRecord
		if err := m.Decode(&rec); err != nil || rec.AllocationID == "" ||
			m.StreamSeq <= read[m.Subject] && holds(rec.AllocationID) {
			b.last[m.Subject] = max(b.last[m.Subject], m.StreamSeq)
			return nil
		}
		n++
		b.record(rec, m.Subject, m.StreamSeq)
		return nil
	}); err != nil {
		return fmt.Errorf("recall usage: %w", err)
	}
	b.forgot, b.hold = "", time.Now().Add(forgetHold)
	b.forgets++
	b.cfg.Log.Info("read back what billing forgot from USAGE", "records", n)
	return nil
}
