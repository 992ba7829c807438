package resourcemanager

import (
	"sync"
	"testing"
	"time"
)

// waitFor waits (bounded) until cond, read under the lock's own mutex,
// holds.
func waitFor(t *testing.T, l *nodeLock, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l.mu.Lock()
		ok := cond()
		l.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// A node's lock has one holder at a time, commits and releases mixed.
func TestNodeLockExcludes(t *testing.T) {
	l := newNodeLock()
	var inside, most, done int
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Go(func() {
			for range 200 {
				l.lock(i%3 == 0)
				mu.Lock()
				inside++
				most = max(most, inside)
				mu.Unlock()
				mu.Lock()
				inside--
				done++
				mu.Unlock()
				l.unlock()
			}
		})
	}
	wg.Wait()
	if most != 1 || done != 64*200 {
		t.Fatalf("at most %d holders at once (want 1), %d of %d writes done", most, done, 64*200)
	}
}

// A commit waiting for a node goes before every release waiting for it,
// whatever came first; with none waiting, releases go on.
func TestNodeLockLetsCommitsFirst(t *testing.T) {
	for _, c := range []struct {
		name               string
		releases, commits  int
		wantCommitsFirstOf int
	}{
		{"one commit behind releases", 5, 1, 1},
		{"commits behind releases", 4, 3, 3},
		{"releases alone", 3, 0, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := newNodeLock()
			l.lock(false)    // a release holds the node
			var order []bool // urgent, in the order the lock was taken
			var mu sync.Mutex
			var wg sync.WaitGroup
			take := func(urgent bool) {
				wg.Go(func() {
					l.lock(urgent)
					mu.Lock()
					order = append(order, urgent)
					mu.Unlock()
					l.unlock()
				})
			}
			for range c.releases {
				take(false)
			}
			waitFor(t, l, "releases waiting", func() bool { return l.waiting == c.releases })
			for range c.commits {
				take(true)
			}
			waitFor(t, l, "commits waiting", func() bool { return l.urgent == c.commits })
			l.unlock()
			wg.Wait()
			if len(order) != c.releases+c.commits {
				t.Fatalf("%d writers took the lock, want %d", len(order), c.releases+c.commits)
			}
			for i, urgent := range order {
				if urgent != (i < c.wantCommitsFirstOf) {
					t.Fatalf("lock taken in order %v (true: a commit); want the %d commits first", order, c.commits)
				}
			}
		})
	}
}
