package scale

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
)

// What grows in the NATS server with history is not told by its RSS: the
// server process writes its live heap's profile when the benchmark sends
// it SIGUSR1 (at every memory row), into nats-heap-<n>.pprof beside its
// log, for `go tool pprof -base` between two rows, and the benchmark
// reports each stream's messages, subjects and consumers at the end.

// serveHeapProfiles writes a heap profile into dir at each SIGUSR1.
func serveHeapProfiles(dir string) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	go func() {
		for n := 0; ; n++ {
			<-sig
			runtime.GC()
			f, err := os.Create(filepath.Join(dir, fmt.Sprintf("nats-heap-%d.pprof", n)))
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				continue
			}
			if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
			_ = f.Close()
		}
	}()
}

// heapProfile asks the server process for a heap profile (see
// serveHeapProfiles).
func (n *natsProc) heapProfile() {
	_ = syscall.Kill(n.pid, syscall.SIGUSR1)
}

// streamState is the part of a stream's /jsz?streams=true entry the
// benchmark reports.
type streamState struct {
	Name  string `json:"name"`
	State struct {
		Messages  uint64 `json:"messages"`
		Bytes     uint64 `json:"bytes"`
		Subjects  int    `json:"num_subjects"`
		Deleted   int    `json:"num_deleted"`
		Consumers int    `json:"consumer_count"`
	} `json:"state"`
}

// streams returns every stream's state, by name.
func (n *natsProc) streams() ([]streamState, error) {
	resp, err := http.Get(n.monitor + "/jsz?streams=true")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var j struct {
		Accounts []struct {
			Streams []streamState `json:"stream_detail"`
		} `json:"account_details"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&j); err != nil {
		return nil, fmt.Errorf("decode /jsz: %w", err)
	}
	var out []streamState
	for _, a := range j.Accounts {
		out = append(out, a.Streams...)
	}
	slices.SortFunc(out, func(a, b streamState) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// streamTable formats streams as lines.
func streamTable(ss []streamState) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%-14s %10s %9s %9s %9s %9s\n", "stream", "messages", "MB", "subjects", "deleted", "consumers")
	for _, s := range ss {
		fmt.Fprintf(&sb, "%-14s %10d %9.1f %9d %9d %9d\n", s.Name, s.State.Messages, float64(s.State.Bytes)/1e6,
			s.State.Subjects, s.State.Deleted, s.State.Consumers)
	}
	return sb.String()
}
