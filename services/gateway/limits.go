package gateway

import (
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// LimitsConfig bounds what one tenant may take from the gateway, so one
// tenant's flood (a script in a loop, a thousand watchers) cannot starve
// the others. The bus has its own limits on a tenant's identity (payload,
// subscriptions: natsauth.TenantLimits).
type LimitsConfig struct {
	// RequestsPerSecond is a tenant's sustained request rate over every
	// route that names it; 0 turns the rate limit off.
	RequestsPerSecond float64
	// Burst is how many requests a quiet tenant may send at once.
	Burst int
	// StreamsPerTenant bounds a tenant's open event and log streams
	// (server-sent events, follow); 0 turns the bound off.
	StreamsPerTenant int
}

// DefaultLimits are generous for people and scripts, tight for a loop.
func DefaultLimits() LimitsConfig {
	return LimitsConfig{RequestsPerSecond: 200, Burst: 400, StreamsPerTenant: 256}
}

// tenantLimits keeps a token bucket and a count of open streams per
// tenant. Buckets of tenants quiet for idleAfter are dropped, so the map
// holds only active tenants.
type tenantLimits struct {
	cfg LimitsConfig
	now func() time.Time

	mu      sync.Mutex
	tenants map[string]*tenantUse
}

type tenantUse struct {
	bucket  *rate.Limiter
	streams int
	last    time.Time
}

const idleAfter = 10 * time.Minute

func newTenantLimits(cfg LimitsConfig, now func() time.Time) *tenantLimits {
	if now == nil {
		now = time.Now
	}
	return &tenantLimits{cfg: cfg, now: now, tenants: map[string]*tenantUse{}}
}

func (l *tenantLimits) use(tenant string, now time.Time) *tenantUse {
	u := l.tenants[tenant]
	if u == nil {
		limit := rate.Limit(l.cfg.RequestsPerSecond)
		if l.cfg.RequestsPerSecond <= 0 {
			limit = rate.Inf
		}
		u = &tenantUse{bucket: rate.NewLimiter(limit, max(l.cfg.Burst, 1))}
		l.tenants[tenant] = u
		if len(l.tenants)%1024 == 0 {
			l.sweep(now)
		}
	}
	u.last = now
	return u
}

// sweep drops the buckets of tenants idle for idleAfter with no stream
// open (a full bucket is what a new one would be anyway).
func (l *tenantLimits) sweep(now time.Time) {
	for t, u := range l.tenants {
		if u.streams == 0 && now.Sub(u.last) > idleAfter {
			delete(l.tenants, t)
		}
	}
}

// allow takes a token of tenant's bucket; when there is none it says how
// long until there is.
func (l *tenantLimits) allow(tenant string) (ok bool, retryAfter time.Duration) {
	if l == nil {
		return true, 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	u := l.use(tenant, now)
	if u.bucket.AllowN(now, 1) {
		return true, 0
	}
	r := u.bucket.ReserveN(now, 1)
	wait := r.DelayFrom(now)
	r.CancelAt(now)
	return false, max(wait, time.Millisecond)
}

// openStream counts one more open stream of tenant and returns its
// release, or false when the tenant has StreamsPerTenant open already.
func (l *tenantLimits) openStream(tenant string) (release func(), ok bool) {
	if l == nil || l.cfg.StreamsPerTenant <= 0 {
		return func() {}, true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	u := l.use(tenant, l.now())
	if u.streams >= l.cfg.StreamsPerTenant {
		return nil, false
	}
	u.streams++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			u.streams--
			l.mu.Unlock()
		})
	}, true
}

// retryAfterSeconds is the Retry-After header's value: whole seconds,
// at least 1.
func retryAfterSeconds(d time.Duration) int {
	return max(1, int(math.Ceil(d.Seconds())))
}
