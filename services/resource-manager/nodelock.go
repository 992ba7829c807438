package resourcemanager

import "sync"

// nodeLock is a node's writer lock: every ledger write to the node (a
// plan item's commit, a release) verifies and publishes under it, one at a
// time, each compare-and-set building on the previous one. It differs from
// a sync.Mutex only in who goes next: a commit waiting for the node goes
// before every release waiting for it.
//
// Why (issue 17, steady load): a node's eight one-GPU jobs are placed
// together and end together, so their eight releases queue on the node's
// lock, one compare-and-set round trip each; the scheduler, seeing the
// first GPU come back, places the next job on that very node (packing),
// and its commit waited behind the remaining releases (commit lock waits
// of 40-70 ms at the 90th percentile, up to a second, with
// ReleaseParallelism 64). A release that waits a few round trips longer
// only holds GPUs the scheduler does not know to be free yet; a commit that
// waits is the latency of a job. Releases are not starved: a node takes
// commits only while it has free devices, and every commit's wait ends
// with the holder's write.
//
// Exclusion is unchanged: one holder at a time, whatever its kind, so a
// device is still verified and written by one writer at a time against
// the latest ledger.
type nodeLock struct {
	mu      sync.Mutex
	turn    sync.Cond // signalled when held or urgent changes
	held    bool
	urgent  int // commits waiting for the lock
	waiting int // releases waiting for the lock
}

func newNodeLock() *nodeLock {
	l := &nodeLock{}
	l.turn.L = &l.mu
	return l
}

// lock takes the lock: urgent (a commit) as soon as it is free, otherwise
// (a release) once it is free and no commit waits for it.
func (l *nodeLock) lock(urgent bool) {
	l.mu.Lock()
	if urgent {
		l.urgent++
		for l.held {
			l.turn.Wait()
		}
		l.urgent--
	} else {
		l.waiting++
		for l.held || l.urgent > 0 {
			l.turn.Wait()
		}
		l.waiting--
	}
	l.held = true
	l.mu.Unlock()
}

// unlock lets the next writer in: a waiting commit first.
func (l *nodeLock) unlock() {
	l.mu.Lock()
	l.held = false
	wake := l.urgent > 0 || l.waiting > 0
	l.mu.Unlock()
	if wake {
		// Every waiter looks again; only one finds the lock free and, if
		// it is a release, no commit waiting. A node has a handful of
		// writers waiting at most (its devices' commits and releases).
		l.turn.Broadcast()
	}
}
