package state

import (
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
)

// Digest describes what the store decides from, canonically: its live
// jobs (state, attempt, request, cancel, parts and what is known of
// them, pending reason), the queue, the plans in flight, the cluster's
// allocations, and the ended jobs, whole or retired, as the record a
// retired one keeps. Two stores rebuilt from the same log, one from a
// snapshot and its tail and one from the streams' beginning, have the
// same digest (the snapshot tests compare them). Not for the hot path.
func (s *Store) Digest() string {
	var b strings.Builder
	var live, ended []string
	for key, j := range s.jobs {
		if j.State.Terminal() {
			ended = append(ended, s.endedLine(key, j))
			continue
		}
		var l strings.Builder
		fmt.Fprintf(&l, "job %s %s attempt=%d seq=%d hash=%x cancel=%t/%s evict=%s retries=%d ckpt=%s later=%d pending=%s/%s pub=%s#%d",
			key, j.State, j.Attempt, j.seq, j.hash[:8], j.cancel, j.cancelReason, j.evict, j.launchRetries,
			j.lastCheckpoint, len(j.later), j.Pending.Code, j.Pending.Message, j.pubPending, j.pendingSeq)
		for _, p := range j.parts {
			fmt.Fprintf(&l, " part[%s node=%s dev=%v flying=%t committed=%t started=%t ended=%t released=%t stop=%s]",
				p.alloc.ID, p.alloc.NodeID, p.alloc.Devices, p.inFlight, p.committed, p.started != nil, p.ended != nil,
				p.released != nil, p.stopSent)
		}
		live = append(live, l.String())
	}
	if s.ret != nil {
		eachRetired(bucketPieces(s.ret.retired.Buckets()), func(k retiredKey, r retiredJob) {
			ended = append(ended, fmt.Sprintf("ended %s %s attempt=%d hash=%016x why=%s", hex.EncodeToString(k[:]),
				terminalStates[r.state], r.attempt, r.hash, s.ret.why[k]))
		})
	}
	slices.Sort(live)
	slices.Sort(ended)
	for _, l := range live {
		b.WriteString(l + "\n")
	}
	for _, l := range ended {
		b.WriteString(l + "\n")
	}
	fmt.Fprintf(&b, "queued %d\n", s.queue.Len())
	var ids []string
	for id := range s.flying {
		ids = append(ids, "flying "+id)
	}
	for id, a := range s.cluster.allocs {
		ids = append(ids, fmt.Sprintf("alloc %s %s %v", id, a.NodeID, a.Devices))
	}
	for id, a := range s.cluster.plans {
		ids = append(ids, fmt.Sprintf("plan %s %s %v", id, a.NodeID, a.Devices))
	}
	slices.Sort(ids)
	for _, l := range ids {
		b.WriteString(l + "\n")
	}
	fmt.Fprintf(&b, "workload %v next=%d\n", s.workload.reqs, s.workload.next)
	return b.String()
}

// endedLine is an ended job as its retired record reads.
func (s *Store) endedLine(key string, j *Job) string {
	k := retiredKeyOf(key)
	h, why := hash64(j.hash), ""
	if j.rejection != nil {
		h, why = hash64(rejectionHash(j.rejection.reason, j.rejection.errors)), string(j.rejection.reason)
	}
	return fmt.Sprintf("ended %s %s attempt=%d hash=%016x why=%s", hex.EncodeToString(k[:]), j.State, max(j.Attempt, 0), h, why)
}
