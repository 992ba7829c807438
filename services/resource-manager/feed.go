package resourcemanager

import (
	"context"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// The heartbeat feed is an ordered consumer of HEARTBEATS. After a NATS
// server dies, the client library rebuilds such a consumer by itself, but
// not always: in about one death in five on a 3-server cluster its
// rebuild kept failing for more than 40 s, with heartbeats stored all the
// while, and it cannot be interrupted (its retries ignore the read's
// context). judgeFeed sees that as a feed behind the stream and holds
// every judgment, which is safe, but a node that really dies meanwhile
// would not be lost. So a feed found behind for longer than the heartbeat
// timeout is replaced: a new consumer starts right after the last
// heartbeat delivered, and the stuck one is abandoned (it is not waited
// for; a late delivery of it is one more heartbeat, harmless).

// heartbeatFeed follows HEARTBEATS from seq until ctx ends, starting a new
// consumer whenever watchLag asks (refeed).
func (s *server) heartbeatFeed(ctx context.Context, seq uint64) error {
	for {
		fctx, cancel := context.WithCancel(ctx)
		failed := make(chan error, 1)
		go func() {
			failed <- s.bus.Follow(fctx, bus.FollowSpec{Stream: contracts.StreamHeartbeats,
				FilterSubjects: []string{contracts.SubjectHeartbeatAll}, StartSeq: seq}, s.onHeartbeatMsg, nil)
		}()
		select {
		case <-ctx.Done():
			cancel()
			return nil
		case err := <-failed:
			cancel()
			if ctx.Err() != nil {
				return nil
			}
			s.log.Warn("heartbeat feed ended; starting a new one", "err", err)
		case <-s.refeed:
			cancel()
			s.log.Warn("heartbeat feed stalled behind the stream; starting a new one")
		}
		s.lifeMu.Lock()
		seq = s.hbSeq + 1
		s.lifeMu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// watchLag records whether the stream was found ahead of the feed at now,
// and asks for a new feed once it has been for longer than the heartbeat
// timeout. Called with lifeMu held.
func (s *server) watchLag(behind bool, now time.Time) {
	switch {
	case !behind:
		s.lagSince = time.Time{}
	case s.lagSince.IsZero():
		s.lagSince = now
	case now.Sub(s.lagSince) > s.cfg.HeartbeatTimeout:
		s.lagSince = time.Time{}
		select {
		case s.refeed <- struct{}{}:
		default:
		}
	}
}
