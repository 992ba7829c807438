// Package lease elects one leader among replicas with a lease in a
// JetStream KV bucket, and hands the leader a fencing epoch.
//
// The key holds a contracts.Lease. A contender takes a free key with Create
// (fails when the key exists) and an expired lease with Update at the
// revision it read, writing epoch+1: both are compare-and-set, so exactly
// one contender wins each term. The leader renews with Update at its last
// revision every TTL/3. It counts its own deadline from the moment before
// each write it sent, so it always believes it holds the lease for less
// time than the stored Expires says; a leader that could not renew by then
// stops (its context is cancelled) before anyone else may take over. This
// assumes clocks that agree to well within a TTL, like every lease; the
// epoch is the backstop: readers refuse work stamped with an older one.
package lease

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// Config configures one contender.
type Config struct {
	KV  jetstream.KeyValue
	Key string
	// Holder names this contender; unique per process (a restarted
	// process is a new contender and waits for the old lease to expire).
	Holder string
	// TTL is how long a lease lasts without renewal.
	TTL time.Duration
	// Now is the clock; default time.Now.
	Now func() time.Time
	Log *slog.Logger
	// SitOut is how long a leader that stepped down (its lead returned
	// ErrStepDown) waits before contending again, so that another
	// contender, which polls every TTL/3, takes the released lease first.
	// Default TTL.
	SitOut time.Duration
}

// Elector contends for one lease key. Its methods are safe for concurrent
// use.
type Elector struct {
	cfg Config

	mu       sync.Mutex
	rev      uint64    // revision of our last write; 0 when not leader
	epoch    uint64    // epoch we hold
	deadline time.Time // our own, conservative end of the lease
}

// New returns an elector; it does nothing until TryAcquire or Run.
func New(cfg Config) (*Elector, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.SitOut <= 0 {
		cfg.SitOut = cfg.TTL
	}
	var errs []error
	if cfg.KV == nil {
		errs = append(errs, errors.New("lease: no KV bucket"))
	}
	if cfg.Key == "" || cfg.Holder == "" {
		errs = append(errs, errors.New("lease: key and holder are required"))
	}
	if cfg.TTL < 30*time.Millisecond {
		errs = append(errs, fmt.Errorf("lease: ttl is %s; want at least 30ms", cfg.TTL))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return &Elector{cfg: cfg}, nil
}

// Term is one leadership term as its holder sees it.
type Term struct {
	Epoch uint64
	e     *Elector
}

// Valid reports whether the lease is still held now: the leader checks it
// right before each fenced publish, so nothing leaves after its deadline.
func (t Term) Valid() bool {
	t.e.mu.Lock()
	defer t.e.mu.Unlock()
	return t.e.epoch == t.Epoch && t.e.rev != 0 && t.e.cfg.Now().Before(t.e.deadline)
}

func (e *Elector) encode(epoch uint64, expires time.Time) []byte {
	b, _ := json.Marshal(contracts.Lease{SchemaVersion: contracts.SchemaVersion, Holder: e.cfg.Holder,
		Epoch: epoch, Expires: expires.UTC()})
	return b
}

// TryAcquire takes the lease when it is free or expired. ok is false when
// someone else holds it, or won the race for it; err is a bus failure.
func (e *Elector) TryAcquire(ctx context.Context) (t Term, ok bool, err error) {
	start := e.cfg.Now()
	expires := start.Add(e.cfg.TTL)
	var epoch, rev uint64
	entry, err := e.cfg.KV.Get(ctx, e.cfg.Key)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		epoch = 1
		rev, err = e.cfg.KV.Create(ctx, e.cfg.Key, e.encode(epoch, expires))
		if bus.IsConflict(err) {
			return Term{}, false, nil
		}
	case err != nil:
		return Term{}, false, fmt.Errorf("lease: read %s: %w", e.cfg.Key, err)
	default:
		var cur contracts.Lease
		if jerr := json.Unmarshal(entry.Value(), &cur); jerr != nil {
			// Never silently reset the epoch: an unreadable lease is an
			// operator's problem, not a free one.
			return Term{}, false, fmt.Errorf("lease: %s holds an unreadable value: %w", e.cfg.Key, jerr)
		}
		if start.Before(cur.Expires) {
			return Term{}, false, nil
		}
		epoch = cur.Epoch + 1
		rev, err = e.cfg.KV.Update(ctx, e.cfg.Key, e.encode(epoch, expires), entry.Revision())
		if bus.IsConflict(err) {
			return Term{}, false, nil // another contender updated it first
		}
	}
	if err != nil {
		return Term{}, false, fmt.Errorf("lease: acquire %s: %w", e.cfg.Key, err)
	}
	e.mu.Lock()
	e.rev, e.epoch, e.deadline = rev, epoch, expires
	e.mu.Unlock()
	return Term{Epoch: epoch, e: e}, true, nil
}

// ErrLost: the lease is no longer ours (someone else wrote the key, or our
// deadline passed).
var ErrLost = errors.New("lease lost")

// Renew extends the lease of t. ErrLost means the term is over for good;
// another error is transient (retry while t.Valid()).
func (e *Elector) Renew(ctx context.Context, t Term) error {
	e.mu.Lock()
	rev, epoch := e.rev, e.epoch
	e.mu.Unlock()
	if rev == 0 || epoch != t.Epoch || !t.Valid() {
		return ErrLost
	}
	start := e.cfg.Now()
	expires := start.Add(e.cfg.TTL)
	nrev, err := e.cfg.KV.Update(ctx, e.cfg.Key, e.encode(epoch, expires), rev)
	if bus.IsConflict(err) {
		e.drop(epoch)
		return ErrLost
	}
	if err != nil {
		return fmt.Errorf("lease: renew %s: %w", e.cfg.Key, err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.epoch != epoch || e.rev != rev {
		return ErrLost
	}
	e.rev, e.deadline = nrev, expires
	return nil
}

// Release ends t now (Expires = now, epoch kept) so a standby takes over
// without waiting for the TTL. Best effort: a failure leaves the lease to
// expire.
func (e *Elector) Release(ctx context.Context, t Term) error {
	e.mu.Lock()
	rev, epoch := e.rev, e.epoch
	e.mu.Unlock()
	if rev == 0 || epoch != t.Epoch {
		return nil
	}
	e.drop(epoch)
	if _, err := e.cfg.KV.Update(ctx, e.cfg.Key, e.encode(epoch, e.cfg.Now()), rev); err != nil {
		return fmt.Errorf("lease: release %s: %w", e.cfg.Key, err)
	}
	return nil
}

func (e *Elector) drop(epoch uint64) {
	e.mu.Lock()
	if e.epoch == epoch {
		e.rev = 0
	}
	e.mu.Unlock()
}

func (e *Elector) deadlineOf(t Term) (time.Time, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.deadline, e.rev != 0 && e.epoch == t.Epoch
}

// ErrStepDown, returned by a lead function (wrapped or joined), ends the
// term but not Run: the lease is released at once and the contender sits
// out Config.SitOut before contending again. A leader that holds the lease
// but cannot do its work (a rebuild that does not finish) returns it, so
// another replica leads instead of the lease being renewed for nothing.
var ErrStepDown = errors.New("lease: leader stepped down")

// Run contends until ctx ends. Each time it wins, it calls lead with a
// context that is cancelled the moment the term ends (a lost renewal, or
// the deadline passing without one) and waits for lead to return before
// contending again. A lead that returns while still leader releases the
// lease. Run returns nil when ctx ends, or lead's error unless it is
// ErrStepDown.
func (e *Elector) Run(ctx context.Context, lead func(ctx context.Context, t Term) error) error {
	retry := time.NewTicker(e.cfg.TTL / 3)
	defer retry.Stop()
	for {
		// Each try has its own bound. A request the bus never answers
		// (sent to a NATS server that died with the connection) is
		// bounded only by its context: by nats.go's 5 s default when ctx
		// has no deadline, by ctx's deadline when it has one (e2e's two
		// minutes), and meanwhile this contender contends no more. A
		// lease acquired after a TTL would be over when won anyway.
		actx, acancel := context.WithTimeout(ctx, e.cfg.TTL)
		t, ok, err := e.TryAcquire(actx)
		acancel()
		if err != nil && ctx.Err() == nil {
			e.cfg.Log.Warn("lease acquire failed; retrying", "key", e.cfg.Key, "err", err)
		}
		wait := retry.C
		if ok {
			e.cfg.Log.Info("leader", "key", e.cfg.Key, "epoch", t.Epoch, "holder", e.cfg.Holder)
			err := e.lead(ctx, t, lead)
			switch {
			case errors.Is(err, ErrStepDown):
				e.cfg.Log.Warn("stepped down; contending again later", "key", e.cfg.Key, "epoch", t.Epoch,
					"sit_out", e.cfg.SitOut, "err", err)
				wait = time.After(e.cfg.SitOut)
			case err != nil:
				return err
			default:
				e.cfg.Log.Info("no longer leader", "key", e.cfg.Key, "epoch", t.Epoch)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wait:
		}
	}
}

// lead runs one term: lead itself, and the renewals that keep it.
func (e *Elector) lead(ctx context.Context, t Term, lead func(context.Context, Term) error) error {
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- lead(lctx, t) }()
	renew := time.NewTicker(e.cfg.TTL / 3)
	defer renew.Stop()
	for {
		deadline, held := e.deadlineOf(t)
		if !held {
			cancel()
			<-done
			return nil
		}
		expiry := time.NewTimer(time.Until(deadline))
		select {
		case err := <-done:
			expiry.Stop()
			// Lead ended on its own (or ctx did): hand over at once.
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), e.cfg.TTL)
			if rerr := e.Release(rctx, t); rerr != nil {
				e.cfg.Log.Warn("lease release failed; it will expire", "err", rerr)
			}
			rcancel()
			if ctx.Err() != nil {
				return nil
			}
			return err
		case <-expiry.C:
			// Not renewed in time: stop leading right now.
			e.cfg.Log.Warn("lease not renewed by its deadline; term over", "key", e.cfg.Key, "epoch", t.Epoch)
			e.drop(t.Epoch)
			cancel()
			<-done // its error is the cancellation we caused
			return nil
		case <-renew.C:
			expiry.Stop()
			// The renewal is bounded by the term's deadline: past it the
			// term is over whatever the answer, and this loop must be
			// free to end it. A renewal whose answer never comes (sent
			// to a NATS server that died with the connection) otherwise
			// waits for lctx's deadline, if any, or nats.go's 5 s: CI saw
			// a term invalid for a minute, refusing every write, never
			// ended and never followed by another.
			rctx, rcancel := context.WithDeadline(lctx, deadline)
			err := e.Renew(rctx, t)
			rcancel()
			if errors.Is(err, ErrLost) {
				e.cfg.Log.Warn("lease lost", "key", e.cfg.Key, "epoch", t.Epoch)
				cancel()
				<-done
				return nil
			}
			if err != nil && lctx.Err() == nil {
				e.cfg.Log.Warn("lease renewal failed; retrying until the deadline", "err", err)
			}
		}
	}
}
