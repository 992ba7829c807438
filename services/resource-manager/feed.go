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

//
// A new consumer starts with the newest heartbeat of each node, not after
// the last one delivered: liveness needs only a node's newest heartbeat,
// and a feed replaced because it fell behind would otherwise replay the
// whole backlog it fell behind on (at 10,000 machines, 5,000 heartbeats a
// second: it never caught up, and was replaced again and again). Every
// heartbeat at or before the last one delivered is skipped by
// onHeartbeatMsg, so a node's old heartbeat delivered again refreshes
// nothing.

// heartbeatFeed follows HEARTBEATS from seq until ctx ends, starting a new
// consumer whenever watchLag asks (refeed).
func (s *server) heartbeatFeed(ctx context.Context, seq uint64) error {
	spec := bus.FollowSpec{Stream: contracts.StreamHeartbeats,
		FilterSubjects: []string{contracts.SubjectHeartbeatAll}, StartSeq: seq}
	for {
		fctx, cancel := context.WithCancel(ctx)
		failed := make(chan error, 1)
		go func() {
			failed <- s.bus.Follow(fctx, spec, s.onHeartbeatMsg, nil)
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
		spec.StartSeq, spec.LastPerSubject = 0, true
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
