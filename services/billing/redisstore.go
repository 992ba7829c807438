package billing

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/gpuplane/gpuplane/contracts"
)

// RedisConfig configures a RedisStore.
type RedisConfig struct {
	// Addr is host:port of a standalone Redis server.
	Addr     string
	Password string
	DB       int
	// Prefix starts every key; the braces make them one Redis Cluster
	// hash slot, so the applying script may touch them all. Default
	// "{gp-billing}:".
	Prefix string
	// Timeout bounds each command; default 2 s.
	Timeout time.Duration
	// BreakerOpen is how long the breaker stays open before it lets one
	// call try again; default 5 s. BreakerFailures consecutive failures
	// open it; default 3.
	BreakerOpen     time.Duration
	BreakerFailures uint32
	// OnBreakerChange, if set, hears every breaker state change.
	OnBreakerChange func(from, to string)
}

// RedisStore is the Store on Redis (go-redis v9), for a shared, durable
// read side. Layout, under Prefix:
//
//	gen                        the content's generation (string)
//	complete                   the generation once it held all of USAGE (MarkComplete)
//	applied:<YYYY-MM-DD>       set of the IDs of the day's applied records
//	tenant:<t>                 hash n, gms, cost, od (Totals)
//	tenant:<t>:day:<date>      hash, the same fields
//	tenant:<t>:month:<YYYY-MM> hash
//	pool:<p>:day:<date>        hash
//	job:<t>:<job>              hash
//	billed                     set of the AllocationKeys (16 bytes) of applied records' allocations
//
// Apply runs one Lua script per batch (applyScript): it checks the
// generation, adds each record's ID to its day's applied set, its
// allocation's ID to billed and the batch's sums to the totals; when
// records were applied before, it writes nothing and the rest is sent
// again. Redis runs a script atomically, so
// markers and totals never disagree.
//
// Every call goes through a circuit breaker (sony/gobreaker): after
// BreakerFailures consecutive failures calls fail fast with
// ErrStoreUnavailable for BreakerOpen. redis.Nil and ErrGenerationChanged
// are answers, not failures; a cancelled context is neither.
//
// Redis may lose the last second of writes when it restarts (appendfsync
// everysec), so the store does not trust content that outlived a restart
// of the server it was opened on: it notices the new run_id on
// reconnection, fails Apply with ErrGenerationChanged, and Open then
// clears the keys and starts a new generation.
type RedisStore struct {
	rdb     *redis.Client
	prefix  string
	timeout time.Duration
	cb      *gobreaker.CircuitBreaker[any]

	// token names this store as the opening lock's holder; openMu keeps
	// its Opens one at a time.
	token  string
	openMu sync.Mutex

	mu    sync.Mutex
	gen   string
	runID string // of the server when Open ran
	lost  bool   // the server restarted since Open
}

var _ Store = (*RedisStore)(nil)

// NewRedisStore returns a store on the Redis of cfg; it connects lazily.
func NewRedisStore(cfg RedisConfig) (*RedisStore, error) {
	if cfg.Addr == "" {
		return nil, errors.New("billing: redis address is empty")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "{gp-billing}:"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Second
	}
	if cfg.BreakerOpen <= 0 {
		cfg.BreakerOpen = 5 * time.Second
	}
	if cfg.BreakerFailures == 0 {
		cfg.BreakerFailures = 3
	}
	s := &RedisStore{prefix: cfg.Prefix, timeout: cfg.Timeout, token: newGeneration()}
	s.rdb = redis.NewClient(&redis.Options{
		Addr: cfg.Addr, Password: cfg.Password, DB: cfg.DB,
		DialTimeout: cfg.Timeout, ReadTimeout: cfg.Timeout, WriteTimeout: cfg.Timeout,
		// Fail fast: the breaker and the bus's redelivery do the retrying.
		MaxRetries: -1,
		OnConnect:  s.onConnect,
	})
	s.cb = gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:        "redis " + cfg.Addr,
		MaxRequests: 1,
		Timeout:     cfg.BreakerOpen,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= cfg.BreakerFailures },
		IsSuccessful: func(err error) bool {
			return err == nil || errors.Is(err, redis.Nil) || errors.Is(err, ErrGenerationChanged) ||
				errors.Is(err, errOpenMoved)
		},
		IsExcluded: func(err error) bool { return errors.Is(err, context.Canceled) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			if cfg.OnBreakerChange != nil {
				cfg.OnBreakerChange(from.String(), to.String())
			}
		},
	})
	return s, nil
}

// Close closes the connections.
func (s *RedisStore) Close() error { return s.rdb.Close() }

// BreakerState is the circuit breaker's state: closed, half-open or open.
func (s *RedisStore) BreakerState() string { return s.cb.State().String() }

// onConnect runs on every new connection: a server whose run_id differs
// from the one Open saw has restarted and may have lost writes.
func (s *RedisStore) onConnect(ctx context.Context, cn *redis.Conn) error {
	id, err := runID(ctx, cn)
	if err != nil {
		return err
	}
	s.mu.Lock()
	if s.runID != "" && id != s.runID {
		s.lost = true
	}
	s.mu.Unlock()
	return nil
}

type infoer interface {
	Info(ctx context.Context, section ...string) *redis.StringCmd
}

func runID(ctx context.Context, c infoer) (string, error) {
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return "", err
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "run_id:"); ok {
			return v, nil
		}
	}
	return "", errors.New("redis INFO server has no run_id")
}

// do runs fn through the breaker with the command timeout.
func (s *RedisStore) do(ctx context.Context, fn func(ctx context.Context) error) error {
	_, err := s.cb.Execute(func() (any, error) {
		ctx, cancel := context.WithTimeout(ctx, s.timeout)
		defer cancel()
		return nil, fn(ctx)
	})
	if errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests) {
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	return err
}

// Open implements Store. It clears the store and starts a new generation
// when the store holds none, or the server restarted since its generation
// began; otherwise it takes the generation there, its own or one another
// replica started.
//
// The server's run_id at a generation's start is kept beside it (genrun).
// A server restarted since (another run_id) may have come back from older
// data, with the generation but without all it confirmed, and a process
// that starts afterwards has no run_id of its own to compare: billing's
// checkpoints trust a generation across processes (issue 17, from a
// review). And a replica that found its generation gone (GPGEN: another
// one started a new generation) takes that one rather than clearing it
// in turn: each clearing the other's made replicas start generations
// without end (from a review; it predates genrun).
//
// Clearing and starting a generation happen under a lock (the opening
// key, held by this store's token for openLockTTL and renewed with every
// page the clear unlinks): two replicas that opened at once cleared at
// once, and the later clear deleted the generation the earlier one had
// just started (a second generation, so a second replay of USAGE), or,
// once its SCAN had passed the generation's key, the records the earlier
// one then applied in a generation that stayed. A replica that finds the
// lock taken waits up to openWait for the generation the holder starts,
// then fails (the projector logs it and tries again). A holder that fails
// lets the lock go; one that dies leaves it to expire.
func (s *RedisStore) Open(ctx context.Context) (string, error) {
	s.openMu.Lock() // one token: two Opens of one store would both hold the lock
	defer s.openMu.Unlock()
	deadline := time.Now().Add(openWait)
	for {
		gen, err := s.openOnce(ctx)
		if err != nil {
			s.letGo(ctx)
			return "", fmt.Errorf("open redis store: %w", err)
		}
		if gen != "" {
			return gen, nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("open redis store: another replica has been starting a generation for %s (it clears "+
				"the store under %s)", openWait, s.lockKey())
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("open redis store: waiting for another replica to start a generation: %w",
				context.Cause(ctx))
		case <-time.After(openPoll):
		}
	}
}

const (
	// openLockTTL bounds how long a dead holder keeps the others waiting;
	// a live one renews it with every page it clears.
	openLockTTL = 30 * time.Second
	// openWait is how long an Open waits for another replica's
	// generation before it fails; openPoll how often it looks.
	openWait = 10 * time.Second
	openPoll = 25 * time.Millisecond
)

// openOnce is one try of Open: the generation, or "" while another
// replica holds the lock (an answer, not a failure, for the breaker).
// Every way to a generation ends by reading the run_id again
// (sameServer): a restart anywhere in between fails the try.
// Each step is its own call through the breaker, with its own timeout: a
// clear of a large store takes many.
func (s *RedisStore) openOnce(ctx context.Context) (string, error) {
	var id, cur string
	var held bool
	err := s.do(ctx, func(ctx context.Context) error {
		var err error
		if id, err = runID(ctx, s.rdb); err != nil {
			return err
		}
		if cur, err = s.current(ctx, id); err != nil {
			return err
		}
		if cur != "" {
			return s.sameServer(ctx, id) // genrun may have outlived a restart since id was read
		}
		// None of this server: start one, under the lock. Read again once
		// it is held: the last holder may have just started one.
		if held, err = s.lock(ctx); err != nil || !held {
			return err
		}
		if cur, err = s.current(ctx, id); err != nil || cur == "" {
			return err
		}
		if err := unlockScript.Run(ctx, s.rdb, []string{s.lockKey()}, s.token).Err(); err != nil {
			return err
		}
		return s.sameServer(ctx, id)
	})
	if err != nil || (cur == "" && !held) {
		return "", err
	}
	if cur == "" {
		if err := s.clear(ctx); err != nil {
			return "", err
		}
		err := s.do(ctx, func(ctx context.Context) error {
			var err error
			cur, err = generationScript.Run(ctx, s.rdb, []string{s.prefix + "gen", s.prefix + "genrun", s.lockKey()},
				newGeneration(), id, s.token).Text()
			if err != nil {
				if strings.HasPrefix(err.Error(), "GPLOCK") {
					err = fmt.Errorf("%w: %w", errOpenMoved, err)
				}
				return err
			}
			// A server that restarted since id was read has the generation
			// under a run_id not its own: every replica would clear it.
			return s.sameServer(ctx, id)
		})
		if err != nil {
			return "", err
		}
	}
	s.mu.Lock()
	s.gen, s.runID, s.lost = cur, id, false
	s.mu.Unlock()
	return cur, nil
}

// sameServer fails when the server's run_id is no longer id.
func (s *RedisStore) sameServer(ctx context.Context, id string) error {
	now, err := runID(ctx, s.rdb)
	if err == nil && now != id {
		err = fmt.Errorf("%w: the server restarted while the store was being opened (run_id %s, then %s)",
			errOpenMoved, id, now)
	}
	return err
}

// errOpenMoved: the lock went, or the server restarted, while the store
// was being opened. An answer, not a failure of the server, for the
// breaker: Open fails and the next one starts afresh.
var errOpenMoved = errors.New("billing store moved while opening")

// letGo lets the opening lock go, if this store holds it, after a failed
// Open: the others need not wait for it to expire. Best effort, and even
// when ctx ended.
func (s *RedisStore) letGo(ctx context.Context) {
	if s.cb.State() == gobreaker.StateOpen {
		return // the server is failing: the lock expires
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.timeout)
	defer cancel()
	_ = unlockScript.Run(ctx, s.rdb, []string{s.lockKey()}, s.token).Err()
}

// current is the store's generation when it was begun under the server's
// run_id id, else "".
func (s *RedisStore) current(ctx context.Context, id string) (string, error) {
	vals, err := s.rdb.MGet(ctx, s.prefix+"gen", s.prefix+"genrun").Result()
	if err != nil {
		return "", err
	}
	cur, _ := vals[0].(string)
	if began, _ := vals[1].(string); began != id {
		return "", nil
	}
	return cur, nil
}

func (s *RedisStore) lockKey() string { return s.prefix + "opening" }

// lock takes the opening lock for this store's token (or renews it, held
// already), and reports whether it holds it.
func (s *RedisStore) lock(ctx context.Context) (bool, error) {
	n, err := lockScript.Run(ctx, s.rdb, []string{s.lockKey()}, s.token, openLockTTL.Milliseconds()).Int()
	return n == 1, err
}

// lockScript takes the lock KEYS[1] for the token ARGV[1], or renews it
// for its holder, for ARGV[2] ms; 1 when held, else 0.
var lockScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v == false or v == ARGV[1] then
	redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
	return 1
end
return 0
`)

// fencedUnlink renews the lock KEYS[1] for ARGV[2] ms and unlinks
// KEYS[2...], only while the token ARGV[1] holds it; 1 when it did, else
// 0. In one script: a clearer whose lock went (expired, evicted, deleted)
// must not take it back, nor let an UNLINK sent before it went land on
// the keys of the generation the next holder began.
var fencedUnlink = redis.NewScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
	return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if #KEYS > 1 then
	redis.call('UNLINK', unpack(KEYS, 2))
end
return 1
`)

// unlockScript lets the lock KEYS[1] go when the token ARGV[1] holds it.
var unlockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
	redis.call('DEL', KEYS[1])
end
return 0
`)

// generationScript starts a generation (KEYS[1], ARGV[1]) begun under the
// server's run_id (KEYS[2], ARGV[2]) and lets the lock (KEYS[3]) go, only
// while the token ARGV[3] holds it: a holder whose lock went while it
// cleared (GPLOCK) must not start one beside the next holder's. It returns
// the generation.
var generationScript = redis.NewScript(`
if redis.call('GET', KEYS[3]) ~= ARGV[3] then
	return redis.error_reply('GPLOCK the opening lock is no longer held')
end
if redis.call('EXISTS', KEYS[1]) == 0 then
	redis.call('SET', KEYS[1], ARGV[1])
	redis.call('SET', KEYS[2], ARGV[2])
end
redis.call('DEL', KEYS[3])
return redis.call('GET', KEYS[1])
`)

// errLockLost: the opening lock went while this store cleared.
var errLockLost = fmt.Errorf("%w: the opening lock went while the store was being cleared", errOpenMoved)

// clear deletes every key of the store but the opening lock, a page of
// SCAN at a time, each its own call with its own timeout (a large store
// takes many), each page unlinked and the lock renewed in one step only
// while this store holds it (fencedUnlink); the generation first: another
// replica's Billed reads the generation and the billed set in one
// transaction, so while the clear runs it answers of no generation (and
// the biller reads USAGE back), never "not billed" in the generation
// whose set is being emptied.
func (s *RedisStore) clear(ctx context.Context) error {
	lockKey, match := s.lockKey(), escapeGlob(s.prefix)+"*"
	unlink := func(ctx context.Context, keys []string) error {
		n, err := fencedUnlink.Run(ctx, s.rdb, append([]string{lockKey}, keys...), s.token, openLockTTL.Milliseconds()).Int()
		if err == nil && n != 1 {
			err = errLockLost
		}
		return err
	}
	if err := s.do(ctx, func(ctx context.Context) error { return unlink(ctx, []string{s.prefix + "gen"}) }); err != nil {
		return err
	}
	var cursor uint64
	for first := true; first || cursor != 0; first = false {
		if err := s.do(ctx, func(ctx context.Context) error {
			keys, next, err := s.rdb.Scan(ctx, cursor, match, 1000).Result()
			if err != nil {
				return err
			}
			if err := unlink(ctx, slices.DeleteFunc(keys, func(k string) bool { return k == lockKey })); err != nil {
				return err
			}
			cursor = next
			return nil
		}); err != nil {
			return err
		}
	}
	return nil
}

func escapeGlob(s string) string {
	return strings.NewReplacer(`\`, `\\`, "*", `\*`, "?", `\?`, "[", `\[`, "]", `\]`).Replace(s)
}

// applyScript applies one batch. Billing's Go side does all it can, so
// that Redis, which runs scripts one at a time, does only what must be
// atomic: Go computes every key and sums the batch per key, so each
// distinct total costs one EXISTS and one HSET (a new hash) or four
// HINCRBY (an existing one) whatever the number of its records; the
// script checks that no record was applied before (one SMISMEMBER per
// day's applied set), marks them all (one SADD per set) and adds the
// sums. When some record was applied before (a redelivery, or another
// batch in flight that shares it), the script writes nothing and names
// those records; Go sums again without them and calls once more. A call
// counts all its records or none.
//
// KEYS[1] is the generation key. ARGV[1] the generation, ARGV[2] the number
// of applied sets S, ARGV[3] the number of totals K; then per set: its
// key, the number M of its records and their IDs; then per total: its key
// and the four sums (records, GPU-ms, cost, on-demand cost); then the
// billed set's key, the number B of the batch's allocations and their
// keys (AllocationKey, 16 bytes; added with the markers: Billed never answers ahead of them, nor
// behind). It returns
// the number of records, or {"dup", id...}: the records applied before.
// The sums go from ARGV to HSET and HINCRBY as strings: Lua never makes
// them doubles.
var applyScript = redis.NewScript(`
local gen = redis.call('GET', KEYS[1])
if gen ~= ARGV[1] then
  return redis.error_reply('GPGEN store generation is ' .. tostring(gen) .. ', not ' .. ARGV[1])
end
local nsets, nkeys = tonumber(ARGV[2]), tonumber(ARGV[3])
local i, nrec, dups = 4, 0, {'dup'}
for _ = 1, nsets do
  local m = tonumber(ARGV[i + 1])
  local present = redis.call('SMISMEMBER', ARGV[i], unpack(ARGV, i + 2, i + 1 + m))
  for j = 1, m do
    if present[j] == 1 then
      dups[#dups + 1] = ARGV[i + 1 + j]
    end
  end
  nrec = nrec + m
  i = i + 2 + m
end
if #dups > 1 then
  return dups
end
i = 4
for _ = 1, nsets do
  local m = tonumber(ARGV[i + 1])
  redis.call('SADD', ARGV[i], unpack(ARGV, i + 2, i + 1 + m))
  i = i + 2 + m
end
for _ = 1, nkeys do
  local key = ARGV[i]
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'n', ARGV[i + 1], 'gms', ARGV[i + 2], 'cost', ARGV[i + 3], 'od', ARGV[i + 4])
  else
    redis.call('HINCRBY', key, 'n', ARGV[i + 1])
    redis.call('HINCRBY', key, 'gms', ARGV[i + 2])
    redis.call('HINCRBY', key, 'cost', ARGV[i + 3])
    redis.call('HINCRBY', key, 'od', ARGV[i + 4])
  end
  i = i + 5
end
local nb = tonumber(ARGV[i + 1])
if nb > 0 then
  redis.call('SADD', ARGV[i], unpack(ARGV, i + 2, i + 1 + nb))
end
return nrec
`)

// maxScriptRecords bounds one script call; larger batches are split into
// even parts sent in one pipeline. The script unpacks a set's IDs onto
// Lua's stack, which holds fewer than 8000.
const maxScriptRecords = 2048

// totalID names a total without building its key: the kind and up to two
// names (tenant, day, month, pool, job), so that summing a batch by key
// allocates nothing per record.
type totalID struct {
	kind byte // 't' tenant, 'd' tenant×day, 'm' tenant×month, 'p' pool×day, 'j' job
	a, b string
}

// key is the total's Redis key, as totalKeys names it.
func (id totalID) key(prefix string) string {
	switch id.kind {
	case 't':
		return prefix + "tenant:" + id.a
	case 'd':
		return prefix + "tenant:" + id.a + ":day:" + id.b
	case 'm':
		return prefix + "tenant:" + id.a + ":month:" + id.b
	case 'p':
		return prefix + "pool:" + id.a + ":day:" + id.b
	default:
		return prefix + "job:" + id.a + ":" + id.b
	}
}

// periods names the days and months of a batch's records, formatting each
// once (a batch's records nearly all start on the same day).
type periods struct {
	unixDay    int64
	day, month string
}

func (p *periods) of(t time.Time) (day, month string) {
	sec := t.Unix()
	d := sec / 86400
	if sec < 0 && sec%86400 != 0 {
		d--
	}
	if p.day == "" || d != p.unixDay {
		p.unixDay, p.day, p.month = d, dayKey(t), monthKey(t)
	}
	return p.day, p.month
}

// applyArgs is the script's ARGV for recs (distinct IDs).
func (s *RedisStore) applyArgs(gen string, recs []contracts.UsageRecord) []any {
	// Most records of a batch are in one day and one job each: size for
	// that.
	type set struct {
		key string
		ids []any
	}
	var sets []*set
	setOf := map[string]*set{}
	totals := make([]Totals, 0, len(recs)+64)
	ids := make([]totalID, 0, len(recs)+64)
	index := make(map[totalID]int, len(recs)+64)
	var per periods
	var allocs []any
	seenAlloc := map[string]struct{}{}
	for _, rec := range recs {
		if _, ok := seenAlloc[rec.AllocationID]; !ok && rec.AllocationID != "" {
			seenAlloc[rec.AllocationID] = struct{}{}
			k := KeyOfAllocation(rec.AllocationID)
			allocs = append(allocs, string(k[:]))
		}
		day, month := per.of(rec.Start)
		st := setOf[day]
		if st == nil {
			st = &set{key: s.prefix + "applied:" + day, ids: make([]any, 0, len(recs))}
			setOf[day] = st
			sets = append(sets, st)
		}
		st.ids = append(st.ids, rec.ID)
		for _, id := range [...]totalID{{'t', rec.Tenant, ""}, {'d', rec.Tenant, day}, {'m', rec.Tenant, month},
			{'p', rec.Pool, day}, {'j', rec.Tenant, rec.JobID}} {
			k, ok := index[id]
			if !ok {
				k = len(totals)
				index[id] = k
				ids = append(ids, id)
				totals = append(totals, Totals{})
			}
			t := &totals[k]
			t.Records++
			t.GPUMillis += rec.GPUMillis
			t.CostMicros += rec.CostMicros
			t.OnDemandMicros += rec.OnDemandCostMicros
		}
	}
	args := make([]any, 0, 3+2*len(sets)+len(recs)+5*len(totals)+2+len(allocs))
	args = append(args, gen, len(sets), len(totals))
	for _, st := range sets {
		args = append(args, st.key, len(st.ids))
		args = append(args, st.ids...)
	}
	for k, t := range totals {
		args = append(args, ids[k].key(s.prefix), t.Records, t.GPUMillis, t.CostMicros, t.OnDemandMicros)
	}
	args = append(args, s.prefix+"billed", len(allocs))
	return append(args, allocs...)
}

// Apply implements Store.
func (s *RedisStore) Apply(ctx context.Context, recs []contracts.UsageRecord) (int, error) {
	s.mu.Lock()
	gen, lost := s.gen, s.lost
	s.mu.Unlock()
	if gen == "" || lost {
		return 0, ErrGenerationChanged
	}
	// A record twice in one batch counts once.
	seen := make(map[string]struct{}, len(recs))
	distinct := make([]contracts.UsageRecord, 0, len(recs))
	for _, r := range recs {
		if _, dup := seen[r.ID]; !dup {
			seen[r.ID] = struct{}{}
			distinct = append(distinct, r)
		}
	}
	var parts [][]contracts.UsageRecord
	size := (len(distinct) + maxScriptRecords - 1) / maxScriptRecords // parts
	if size > 0 {
		size = (len(distinct) + size - 1) / size // records per part, even
	}
	for chunk := range chunks(distinct, size) {
		parts = append(parts, chunk)
	}
	applied := 0
	// Each round sends every part left; a part that met records applied
	// before is sent again without them. Two rounds nearly always do;
	// more only when another writer applies the same records meanwhile.
	for round := 0; len(parts) > 0; round++ {
		if round == 10 {
			return applied, fmt.Errorf("redis store: records keep being applied by another writer; %d parts left", len(parts))
		}
		var again [][]contracts.UsageRecord
		err := s.do(ctx, func(ctx context.Context) error {
			send := func() ([]*redis.Cmd, error) {
				pipe := s.rdb.Pipeline()
				cmds := make([]*redis.Cmd, 0, len(parts))
				for _, part := range parts {
					cmds = append(cmds, applyScript.EvalSha(ctx, pipe, []string{s.prefix + "gen"}, s.applyArgs(gen, part)...))
				}
				_, err := pipe.Exec(ctx)
				return cmds, err
			}
			cmds, err := send()
			if err != nil && strings.Contains(err.Error(), "NOSCRIPT") {
				// First use on this server: load the script, then once more.
				if err := applyScript.Load(ctx, s.rdb).Err(); err != nil {
					return err
				}
				cmds, err = send()
			}
			for p, c := range cmds {
				if cerr := c.Err(); cerr != nil {
					if strings.Contains(cerr.Error(), "GPGEN") {
						return fmt.Errorf("%w: %v", ErrGenerationChanged, cerr)
					}
					return cerr
				}
				switch v := c.Val().(type) {
				case int64:
					applied += int(v)
				case []any:
					if rest := withoutDuplicates(parts[p], v); len(rest) > 0 {
						again = append(again, rest)
					}
				}
			}
			return err
		})
		if errors.Is(err, ErrGenerationChanged) {
			s.mu.Lock()
			s.lost = true
			s.mu.Unlock()
		}
		if err != nil {
			return applied, err
		}
		parts = again
	}
	return applied, nil
}

// withoutDuplicates is part without the records the script answered were
// applied before ({"dup", id...}).
func withoutDuplicates(part []contracts.UsageRecord, answer []any) []contracts.UsageRecord {
	dup := make(map[string]bool, len(answer))
	for _, v := range answer[1:] {
		if id, ok := v.(string); ok {
			dup[id] = true
		}
	}
	out := make([]contracts.UsageRecord, 0, len(part))
	for _, r := range part {
		if !dup[r.ID] {
			out = append(out, r)
		}
	}
	return out
}

// chunks yields recs in slices of at most n.
func chunks(recs []contracts.UsageRecord, n int) func(func([]contracts.UsageRecord) bool) {
	return func(yield func([]contracts.UsageRecord) bool) {
		for len(recs) > 0 {
			k := min(n, len(recs))
			if !yield(recs[:k]) {
				return
			}
			recs = recs[k:]
		}
	}
}

// Billed implements Store: the generation and the billed set are read in
// one transaction. A store whose server restarted since Open answers
// ErrGenerationChanged (what it holds may have lost its last writes).
func (s *RedisStore) Billed(ctx context.Context, keys []AllocationKey) (string, []bool, error) {
	s.mu.Lock()
	gen, lost := s.gen, s.lost
	s.mu.Unlock()
	if gen == "" || lost {
		return "", nil, ErrGenerationChanged
	}
	var cur string
	out := make([]bool, len(keys))
	err := s.do(ctx, func(ctx context.Context) error {
		var genCmd *redis.StringCmd
		var isCmd *redis.BoolSliceCmd
		_, err := s.rdb.TxPipelined(ctx, func(pipe redis.Pipeliner) error {
			genCmd = pipe.Get(ctx, s.prefix+"gen")
			if len(keys) > 0 {
				members := make([]any, len(keys))
				for i, k := range keys {
					members[i] = string(k[:])
				}
				isCmd = pipe.SMIsMember(ctx, s.prefix+"billed", members...)
			}
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
		cur = genCmd.Val()
		if isCmd != nil {
			copy(out, isCmd.Val())
		}
		return nil
	})
	if err != nil {
		return "", nil, fmt.Errorf("redis store: billed: %w", err)
	}
	// A connection made for this call to a restarted server (onConnect)
	// read content that may have lost its last writes.
	if s.restarted() {
		return "", nil, ErrGenerationChanged
	}
	return cur, out, nil
}

// Generation implements Store: Billed's probe.
func (s *RedisStore) Generation(ctx context.Context) (string, error) {
	gen, _, err := s.Billed(ctx, nil)
	return gen, err
}

// markCompleteScript marks the generation ARGV[1] complete (KEYS[2])
// while it is the store's (KEYS[1]).
var markCompleteScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
	return 0
end
redis.call('SET', KEYS[2], ARGV[1])
return 1
`)

// MarkComplete implements Store. A store whose server restarted since
// Open answers ErrGenerationChanged and marks nothing: the generation may
// have lost its last writes, so it is not complete, whatever its replay
// acknowledged. The check and the mark take one connection: a connection
// is checked when it is made (onConnect), and a restart after that drops
// it, so a mark that succeeds on it was made on the server checked.
func (s *RedisStore) MarkComplete(ctx context.Context, generation string) error {
	var marked int
	err := s.do(ctx, func(ctx context.Context) error {
		cn := s.rdb.Conn()
		defer cn.Close()
		if err := cn.Ping(ctx).Err(); err != nil {
			return err
		}
		if s.restarted() {
			return ErrGenerationChanged
		}
		var err error
		marked, err = markCompleteScript.Run(ctx, cn, []string{s.prefix + "gen", s.prefix + "complete"}, generation).Int()
		return err
	})
	if err != nil {
		return fmt.Errorf("redis store: mark complete: %w", err)
	}
	if marked != 1 { // another generation
		return ErrGenerationChanged
	}
	return nil
}

// restarted reports whether the server restarted since Open (onConnect).
func (s *RedisStore) restarted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lost
}

// unopened reports whether Open has not yet succeeded: the store has no
// server run of its own to compare (onConnect notices no restart).
func (s *RedisStore) unopened() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runID == ""
}

// CompleteTenantDay implements Store.
func (s *RedisStore) CompleteTenantDay(ctx context.Context, tenant string, day time.Time) (Totals, error) {
	return s.getComplete(ctx, tenantDayKey(tenant, day))
}

// CompleteTenantMonth implements Store.
func (s *RedisStore) CompleteTenantMonth(ctx context.Context, tenant string, month time.Time) (Totals, error) {
	return s.getComplete(ctx, tenantMonthKey(tenant, month))
}

// getComplete reads the totals of key, the generation and its mark in
// one transaction: ErrIncomplete unless the generation is marked
// complete. A server restarted since Open may have lost writes the mark
// counts on: incomplete too (until the projector opens a new generation
// and fills it). So is a store not yet opened: it cannot tell a restart
// (a server back from its files keeps gen and complete, and Open would
// start over).
func (s *RedisStore) getComplete(ctx context.Context, key string) (Totals, error) {
	if s.unopened() {
		return Totals{}, fmt.Errorf("%w: the store is not open yet", ErrIncomplete)
	}
	if s.restarted() {
		return Totals{}, fmt.Errorf("%w: the server restarted", ErrIncomplete)
	}
	var t Totals
	var gen, complete string
	err := s.do(ctx, func(ctx context.Context) error {
		var genCmd, completeCmd *redis.StringCmd
		var totalsCmd *redis.SliceCmd
		_, err := s.rdb.TxPipelined(ctx, func(pipe redis.Pipeliner) error {
			genCmd = pipe.Get(ctx, s.prefix+"gen")
			completeCmd = pipe.Get(ctx, s.prefix+"complete")
			totalsCmd = pipe.HMGet(ctx, s.prefix+key, totalFields...)
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
		gen, complete = genCmd.Val(), completeCmd.Val()
		return parseTotals(s.prefix+key, totalsCmd.Val(), &t)
	})
	if err != nil {
		return Totals{}, fmt.Errorf("redis store: %s: %w", key, err)
	}
	if s.restarted() {
		return Totals{}, fmt.Errorf("%w: the server restarted", ErrIncomplete)
	}
	if gen == "" || complete != gen {
		return Totals{}, ErrIncomplete
	}
	return t, nil
}

// totalFields are a totals hash's fields, in Totals' order.
var totalFields = []string{"n", "gms", "cost", "od"}

// parseTotals reads HMGET's answer for totalFields (of key) into t.
func parseTotals(key string, vals []any, t *Totals) error {
	dst := []*int64{&t.Records, &t.GPUMillis, &t.CostMicros, &t.OnDemandMicros}
	for i, v := range vals {
		if str, ok := v.(string); ok {
			n, err := strconv.ParseInt(str, 10, 64)
			if err != nil {
				return fmt.Errorf("redis %s: %w", key, err)
			}
			*dst[i] = n
		}
	}
	return nil
}

func (s *RedisStore) get(ctx context.Context, key string) (Totals, error) {
	var t Totals
	err := s.do(ctx, func(ctx context.Context) error {
		vals, err := s.rdb.HMGet(ctx, s.prefix+key, totalFields...).Result()
		if err != nil {
			return err
		}
		return parseTotals(s.prefix+key, vals, &t)
	})
	return t, err
}

// Tenant implements Store.
func (s *RedisStore) Tenant(ctx context.Context, tenant string) (Totals, error) {
	return s.get(ctx, "tenant:"+tenant)
}

// TenantDay implements Store.
func (s *RedisStore) TenantDay(ctx context.Context, tenant string, day time.Time) (Totals, error) {
	return s.get(ctx, tenantDayKey(tenant, day))
}

// TenantMonth implements Store.
func (s *RedisStore) TenantMonth(ctx context.Context, tenant string, month time.Time) (Totals, error) {
	return s.get(ctx, tenantMonthKey(tenant, month))
}

// PoolDay implements Store.
func (s *RedisStore) PoolDay(ctx context.Context, pool string, day time.Time) (Totals, error) {
	return s.get(ctx, "pool:"+pool+":day:"+dayKey(day))
}

// Job implements Store.
func (s *RedisStore) Job(ctx context.Context, tenant, jobID string) (Totals, error) {
	return s.get(ctx, "job:"+tenant+":"+jobID)
}
