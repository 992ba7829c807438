package resourcemanager

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/services/resource-manager/internal/liveness"
)

// onNodesMsg applies an inventory or a lifecycle event of NODES. With
// publish false (the rebuild) it only records; registrations it owes are
// published once the rebuild is over. The node is the subject's token,
// never the body's.
func (s *server) onNodesMsg(ctx context.Context, m *bus.Msg, publish bool) {
	node := contracts.Token(m.Subject, 3)
	log := s.log.With("subject", m.Subject, "stream_seq", m.StreamSeq, "node_id", node)
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	if m.StreamSeq <= s.nodesSeq[node] {
		// Read already by a catch-up: applying it again could put an
		// older inventory back over a newer one.
		return
	}
	s.nodesSeq[node] = m.StreamSeq
	switch {
	case strings.HasPrefix(m.Subject, "gp.nodes.inventory."):
		var inv contracts.NodeInventory
		if err := m.Decode(&inv); err != nil {
			log.Warn("undecodable inventory skipped", "err", err)
			return
		}
		if inv.NodeID != node {
			log.Warn("inventory names another node; the subject wins", "body_node_id", inv.NodeID)
			inv.NodeID = node
		}
		s.mu.Lock()
		err := s.led.SetInventory(inv)
		s.mu.Unlock()
		if err != nil {
			// Recorded anyway; the GPUs named take no new allocation
			// until the agent reports a consistent MIG state.
			log.Warn("inventory kept, GPUs unusable", "err", err)
		}
		d, owed := s.tracker.Inventory(inv, s.cfg.Now())
		if owed && publish {
			s.publishLifecycle(ctx, d)
		}
	case strings.HasPrefix(m.Subject, "gp.nodes.lifecycle."):
		var ev contracts.NodeEvent
		if err := m.Decode(&ev); err != nil {
			log.Warn("undecodable node event skipped", "err", err)
			return
		}
		ev.NodeID = node
		s.applyLifecycle(ev, m.StreamSeq)
	}
}

// catchUpNode reads the node's inventory and lifecycle messages that NODES
// holds past what this manager applied. The scheduler and this manager
// follow NODES separately, so a plan can name a node whose first
// inventory the scheduler has read and this manager not yet: such a plan
// is answered on what the stream holds, not on how far this manager's
// follow has got (a refused gang part would cost the whole gang an
// attempt). An inventory read here owes the node's registration, which is
// published as the follow would.
func (s *server) catchUpNode(ctx context.Context, node string) error {
	s.lifeMu.Lock()
	last := s.nodesSeq[node]
	s.lifeMu.Unlock()
	_, err := s.bus.Replay(ctx, bus.FollowSpec{Stream: contracts.StreamNodes,
		FilterSubjects: []string{contracts.SubjectInventory(node), contracts.SubjectNodeLifecycle(node)}, StartSeq: last + 1},
		func(ctx context.Context, m *bus.Msg) error {
			s.onNodesMsg(ctx, m, true)
			return nil
		})
	if err != nil {
		return fmt.Errorf("catch up node %s: %w", node, err)
	}
	return nil
}

// onHeartbeatMsg records a heartbeat; a lost node's heartbeat brings it
// back (returned, or registered for a new incarnation).
func (s *server) onHeartbeatMsg(ctx context.Context, m *bus.Msg) error {
	s.observe(m.Timestamp) // NATS time, for dates (observe)
	node := contracts.Token(m.Subject, 2)
	incarnation, err := heartbeatIncarnation(m.Data)
	if err != nil {
		s.log.Warn("undecodable heartbeat skipped", "subject", m.Subject, "stream_seq", m.StreamSeq, "err", err)
		return nil
	}
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	if m.StreamSeq <= s.hbSeq {
		// Delivered before, or stored before this manager listened: a
		// replaced feed starts with each node's newest heartbeat (feed.go).
		return nil
	}
	s.hbSeq = m.StreamSeq
	if d, owed := s.tracker.Heartbeat(node, incarnation, m.StreamSeq, s.cfg.Now()); owed {
		s.publishLifecycle(ctx, d)
	}
	return nil
}

// publishLifecycle publishes a decided lifecycle event and applies it.
// Called with lifeMu held. A failure is logged: the decision is
// level-triggered and comes again at the next liveness check.
func (s *server) publishLifecycle(ctx context.Context, d liveness.Decision) {
	node := d.Event.NodeID
	if !s.leading() {
		s.log.Warn("node event refused: lease term over", "node_id", node, "kind", string(d.Event.Kind))
		return
	}
	// The ledger takes the decision before it is announced: whoever reads
	// "registered" may send a plan for the node at once, and whoever reads
	// "lost" must not find it still taking allocations.
	s.mu.Lock()
	s.led.SetReady(node, d.Event.Kind != contracts.NodeLost)
	s.mu.Unlock()
	ack, err := s.bus.Publish(ctx, contracts.SubjectNodeLifecycle(node), d.ID, d.Event, bus.CESubject(node))
	if err != nil {
		// Not announced: back to what the stored lifecycle says.
		ready := s.tracker.Status(node) == liveness.Ready
		s.mu.Lock()
		s.led.SetReady(node, ready)
		s.mu.Unlock()
		if ctx.Err() == nil {
			s.log.Warn("node event not published; will decide again", "node_id", node, "kind", string(d.Event.Kind), "err", err)
		}
		return
	}
	if s.applyLifecycle(d.Event, ack.Sequence) {
		s.log.Info("node "+string(d.Event.Kind), "node_id", node, "incarnation", d.Event.Incarnation,
			"reason", d.Event.Reason, "stream_seq", ack.Sequence)
	}
}

// applyLifecycle folds a stored lifecycle event into the tracker and the
// ledger's readiness. Called with lifeMu held.
func (s *server) applyLifecycle(ev contracts.NodeEvent, seq uint64) bool {
	changed := s.tracker.Apply(ev, seq, s.cfg.Now())
	ready := s.tracker.Status(ev.NodeID) == liveness.Ready
	s.mu.Lock()
	s.led.SetReady(ev.NodeID, ready)
	s.mu.Unlock()
	return changed
}

// livenessLoop checks liveness every LivenessInterval until ctx ends.
func (s *server) livenessLoop(ctx context.Context) error {
	t := time.NewTicker(s.cfg.LivenessInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.checkLiveness(ctx)
		}
	}
}

// checkLiveness publishes every lifecycle event owed now (registrations,
// lost nodes), then releases, with reason node_lost, every live allocation
// of a lost node, whoever declared it lost and whenever it was committed.
// Level-triggered: whatever fails is done at the next check.
func (s *server) checkLiveness(ctx context.Context) {
	s.judgeFeed(ctx)
	s.lifeMu.Lock()
	now := s.cfg.Now()
	for _, d := range s.tracker.Due(now) {
		s.publishLifecycle(ctx, d)
	}
	lost := s.tracker.Lost()
	s.lifeMu.Unlock()
	for _, node := range lost {
		s.mu.Lock()
		live := s.led.Live(node)
		started := make(map[string]time.Time, len(live))
		for _, a := range live {
			started[a.ID] = s.started[a.ID]
		}
		s.mu.Unlock()
		for _, a := range live {
			run := &contracts.RunResult{Outcome: contracts.OutcomeFailed, StartedAt: started[a.ID], EndedAt: now,
				Reason: contracts.ReasonNodeLost, Message: "node " + node + " stopped sending heartbeats"}
			if err := s.release(ctx, a.ID, contracts.ReasonNodeLost, run); err != nil && ctx.Err() == nil {
				s.log.Warn("release of a lost node's allocation failed; will retry", "node_id", node, "alloc_id", a.ID, "err", err)
			}
		}
	}
}

// judgeFeed checks this manager's own heartbeat feed before any node is
// judged by it, whenever a verdict hangs on it: a ready node has been
// silent past the timeout, or no heartbeat of any node has come for
// FeedGap. The HEARTBEATS stream is the witness: what it holds is what the
// agents got through, whatever this manager's consumer delivered.
//   - Connection down, or the stream not answering (no leader, timeout):
//     judgment is held; the feed's return restarts every clock.
//   - The stream holds a suspect's heartbeat newer than the last one
//     delivered: the node is alive and the feed late (Refresh); on a quiet
//     feed, any heartbeat newer than the last delivered holds judgment.
//   - Otherwise the stream confirms the silence: a held judgment resumes
//     (clocks restarted once), and suspects are lost at the next Due.
//
// The probes run without lifeMu: heartbeats keep being applied meanwhile.
func (s *server) judgeFeed(ctx context.Context) {
	s.lifeMu.Lock()
	now := s.cfg.Now()
	quiet := s.tracker.FeedQuiet(now)
	suspects := s.tracker.Suspects(now)
	lastSeq := s.hbSeq
	s.lifeMu.Unlock()
	if !quiet && len(suspects) == 0 {
		return
	}
	trusted, behind, refresh := s.probeFeed(ctx, quiet, lastSeq, suspects)
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	now = s.cfg.Now()
	s.watchLag(behind, now)
	switch {
	case !trusted:
		if !s.tracker.Held() {
			s.log.Warn("heartbeat feed cannot be trusted: no node is judged until it is whole again", "suspects", len(suspects))
		}
		s.tracker.Hold()
	default:
		if s.tracker.Held() {
			s.log.Info("heartbeat feed whole again: every node's clock restarts")
		}
		s.tracker.Resume(now)
		for node, seq := range refresh {
			s.tracker.Refresh(node, seq, now)
		}
	}
}

// probeTimeout bounds one probe of the HEARTBEATS stream.
const probeTimeout = 2 * time.Second

// probeFeed asks the stream (see judgeFeed). trusted is false when the
// feed cannot be trusted; behind is true when the stream holds heartbeats
// the feed has not delivered; refresh holds, per suspect the stream knows
// newer heartbeats of, the newest one's sequence.
func (s *server) probeFeed(ctx context.Context, quiet bool, lastSeq uint64, suspects []liveness.Suspect) (trusted, behind bool, refresh map[string]uint64) {
	if !s.bus.Conn().IsConnected() {
		return false, false, nil
	}
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	// Stream info is answered by the stream's leader only: an error is a
	// stream without one (an election after a server's death).
	stream, err := s.bus.JetStream().Stream(pctx, contracts.StreamHeartbeats)
	if err != nil {
		return false, false, nil
	}
	info := stream.CachedInfo()
	if info.Cluster != nil && info.Cluster.Leader == "" {
		return false, false, nil
	}
	if quiet && info.State.LastSeq > lastSeq {
		// Heartbeats are stored that the feed has not delivered.
		return false, true, nil
	}
	refresh = map[string]uint64{}
	for _, sp := range suspects {
		msg, err := stream.GetLastMsgForSubject(pctx, contracts.SubjectHeartbeat(sp.ID))
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
		case err != nil:
			return false, false, nil
		case msg.Sequence > max(sp.HeartbeatSeq, s.hbStart):
			// Stored before this manager started listening, a heartbeat
			// says nothing of now.
			refresh[sp.ID] = msg.Sequence
		}
	}
	return true, len(refresh) > 0, refresh
}
