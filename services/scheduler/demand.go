package scheduler

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/demand"
)

// demandPublisher publishes each pool's PoolDemand when it changed, at most
// once per interval per pool: cycles may run every few milliseconds, the
// autoscaler needs the trend, not every step. The latest figures always win.
type demandPublisher struct {
	pub      publisher
	log      *slog.Logger
	interval time.Duration
	idPrefix string // demand/<scheduler>/<boot>/: unique per process start

	mu   sync.Mutex
	want map[string]contracts.PoolDemand
	kick chan struct{}

	sent map[string]sentDemand // owned by run
	seq  uint64
}

type sentDemand struct {
	d  contracts.PoolDemand
	at time.Time
}

func newDemandPublisher(pub publisher, interval time.Duration, name, boot string, log *slog.Logger) *demandPublisher {
	return &demandPublisher{pub: pub, log: log, interval: interval, idPrefix: "demand/" + name + "/" + boot + "/",
		kick: make(chan struct{}, 1), sent: map[string]sentDemand{}}
}

// update hands over the demand after a cycle. It never blocks.
func (p *demandPublisher) update(d map[string]contracts.PoolDemand) {
	p.mu.Lock()
	p.want = d
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

func (p *demandPublisher) run(ctx context.Context) error {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		next := p.flush(ctx)
		wait := time.Hour
		if !next.IsZero() {
			wait = max(time.Until(next), time.Millisecond)
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return nil
		case <-p.kick:
		case <-timer.C:
		}
	}
}

// flush publishes every changed pool whose interval has passed and returns
// when the next held-back change becomes due (zero: none).
func (p *demandPublisher) flush(ctx context.Context) time.Time {
	p.mu.Lock()
	want := p.want
	p.mu.Unlock()
	var next time.Time
	due := func(t time.Time) {
		if next.IsZero() || t.Before(next) {
			next = t
		}
	}
	now := time.Now()
	for pool, d := range want {
		last, ok := p.sent[pool]
		if ok && demand.Same(last.d, d) {
			continue
		}
		if ok && now.Sub(last.at) < p.interval {
			due(last.at.Add(p.interval))
			continue
		}
		p.seq++
		id := p.idPrefix + pool + "/" + strconv.FormatUint(p.seq, 10)
		if _, err := p.pub.Publish(ctx, contracts.SubjectDemand(pool), id, d); err != nil {
			if ctx.Err() == nil {
				p.log.Warn("demand publish failed", "pool", pool, "err", err)
				due(now.Add(p.interval))
			}
			continue
		}
		p.sent[pool] = sentDemand{d: d, at: now}
	}
	return next
}
