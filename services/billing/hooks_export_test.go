package billing

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// BeforeLockCall runs f before the n-th (1-based) call that takes or
// renews s's opening lock (tests of what happens meanwhile).
func BeforeLockCall(s *RedisStore, n int32, f func()) {
	var calls atomic.Int32
	hashes := map[string]bool{lockScript.Hash(): true, fencedUnlink.Hash(): true}
	s.rdb.AddHook(cmdHook{f: func(cmd redis.Cmder) {
		if a := cmd.Args(); cmd.Name() == "evalsha" && len(a) > 1 && hashes[a[1].(string)] && calls.Add(1) == n {
			f()
		}
	}})
}

// BeforeCommand runs f before each command of s named name (lower case).
func BeforeCommand(s *RedisStore, name string, f func(cmd redis.Cmder)) {
	s.rdb.AddHook(cmdHook{f: func(cmd redis.Cmder) {
		if cmd.Name() == name {
			f(cmd)
		}
	}})
}

type cmdHook struct{ f func(redis.Cmder) }

func (h cmdHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h cmdHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.f(cmd)
		return next(ctx, cmd)
	}
}
func (h cmdHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
