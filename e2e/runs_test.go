package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
)

// TestRealCommandsAndTheirLogs runs real commands (sh -c) through the whole
// platform and reads their output back through the gateway, the way
// `gpuctl logs` does: a failing command with stdout and stderr, a command
// followed while it writes, an output larger than many log chunks, and a
// job that answers a checkpoint command under the documented protocol.
func TestRealCommandsAndTheirLogs(t *testing.T) {
	s := startStack(t, nil)
	w := s.watchJobs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	submit := func(id string, gpus int, script string) {
		t.Helper()
		body, err := json.Marshal(map[string]any{
			"id":        id,
			"resources": map[string]any{"gpu": map[string]any{"count": gpus, "model": "H100-80GB"}},
			"run":       map[string]any{"command": []string{"sh", "-c", script}, "duration": "60s", "checkpoint": id == "ckpt"},
		})
		if err != nil {
			t.Fatal(err)
		}
		code, resp, err := s.submitAPI(ctx, "acme", body)
		if err != nil || code != http.StatusAccepted {
			t.Fatalf("submit %s: %d %s %v", id, code, resp, err)
		}
	}
	terminal := func(id string) contracts.JobEvent {
		t.Helper()
		var ev contracts.JobEvent
		waitFor(t, 60*time.Second, id+" terminal", func() (bool, string) {
			e, ok := w.get("acme/" + id)
			ev = e
			return ok && e.State.Terminal(), fmt.Sprintf("%s is %s", id, e.State)
		})
		return ev
	}

	// 1. stdout and stderr, the exit code, and exactly the allocated GPUs.
	submit("visible", 2, `echo "visible=$CUDA_VISIBLE_DEVICES nvidia=$NVIDIA_VISIBLE_DEVICES"; echo "to stderr" >&2; exit 3`)
	// 2. followed from before it starts until it ends by itself.
	submit("follow", 1, `for i in 1 2 3 4 5 6; do echo "line $i"; sleep 0.25; done`)
	// 3. 300,000 bytes: about ten 32 KiB chunks, shipped while it runs.
	submit("large", 1, `i=0; while [ $i -lt 3000 ]; do printf '%099d\n' $i; i=$((i+1)); done`)
	// 4. a job that checkpoints on SIGUSR1 (the protocol in FLOWS.md).
	submit("ckpt", 1, `n=0
trap 'n=$((n+1)); d="$GPUPLANE_CHECKPOINT_DIR/step-$n"; mkdir -p "$d"; echo "$n" > "$d/state";
      echo "step-$n" > "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp"; mv "$GPUPLANE_CHECKPOINT_DIR/LATEST.tmp" "$GPUPLANE_CHECKPOINT_DIR/LATEST"; echo "checkpointed $n"' USR1
i=0; while [ $i -lt 80 ] && [ $n -lt 1 ]; do sleep 0.1; i=$((i+1)); done
echo "done after $n checkpoints"`)

	// Follow "follow" from as soon as the gateway knows it (queued, or
	// already scheduled or running): the answer must hold all its output.
	waitFor(t, 30*time.Second, "follow known", func() (bool, string) {
		e, ok := w.get("acme/follow")
		return ok && !e.State.Terminal(), "not yet queued"
	})
	time.Sleep(100 * time.Millisecond) // the gateway's read model trails the stream a little
	followed := make(chan logResult, 1)
	go func() { followed <- getLogs(ctx, s.ep.GatewayURL, "follow", "?follow=true") }()

	ev := terminal("visible")
	if ev.State != contracts.StateFailed || ev.ExitCode == nil || *ev.ExitCode != 3 {
		t.Fatalf("visible ended %s with exit %v, want failed with 3", ev.State, ev.ExitCode)
	}
	var uuids []string
	for _, d := range placementOf(t, s, "visible").Devices {
		uuids = append(uuids, d.VisibleUUID())
	}
	if len(uuids) != 2 {
		t.Fatalf("visible placed on %v, want 2 GPUs", uuids)
	}
	all := strings.Join(uuids, ",")
	want := "visible=" + all + " nvidia=" + all + "\nto stderr\n"
	got := getLogs(ctx, s.ep.GatewayURL, "visible", "")
	if got.err != nil || got.body != want || got.exit != "3" || got.complete != "true" {
		t.Fatalf("logs of visible = %q exit %q complete %q err %v\nwant %q exit 3 complete", got.body, got.exit, got.complete, got.err, want)
	}

	if ev := terminal("follow"); ev.State != contracts.StateSucceeded {
		t.Fatalf("follow ended %s", ev.State)
	}
	select {
	case f := <-followed:
		want := "line 1\nline 2\nline 3\nline 4\nline 5\nline 6\n"
		if f.err != nil || f.body != want || f.exit != "0" || f.complete != "true" {
			t.Fatalf("followed logs = %q exit %q complete %q err %v, want %q", f.body, f.exit, f.complete, f.err, want)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("following the logs of a finished job did not end by itself")
	}

	if ev := terminal("large"); ev.State != contracts.StateSucceeded {
		t.Fatalf("large ended %s", ev.State)
	}
	large := getLogs(ctx, s.ep.GatewayURL, "large", "")
	if large.err != nil || len(large.body) != 300_000 || large.complete != "true" {
		t.Fatalf("logs of large: %d bytes complete %q err %v, want 300000 complete", len(large.body), large.complete, large.err)
	}
	for i, line := range strings.Split(strings.TrimSuffix(large.body, "\n"), "\n") {
		if n, err := strconv.Atoi(line); err != nil || n != i || len(line) != 99 {
			t.Fatalf("line %d of large is %q", i, line)
		}
	}

	// Ask "ckpt" for a checkpoint once it runs; the agent reports it.
	waitFor(t, 30*time.Second, "ckpt running", func() (bool, string) {
		e, _ := w.get("acme/ckpt")
		return e.State == contracts.StateRunning, string(e.State)
	})
	resp, err := authClient.Post(s.ep.GatewayURL+"/v1/tenants/acme/jobs/ckpt/checkpoint", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("checkpoint: %d %s", resp.StatusCode, b)
	}
	if ev := terminal("ckpt"); ev.State != contracts.StateSucceeded {
		t.Fatalf("ckpt ended %s", ev.State)
	}
	ck := getLogs(ctx, s.ep.GatewayURL, "ckpt", "")
	if ck.body != "checkpointed 1\ndone after 1 checkpoints\n" {
		t.Fatalf("logs of ckpt = %q", ck.body)
	}
	facts := runFacts(t, ctx, s, "acme/ckpt/1")
	if c := facts[contracts.RunCheckpointed]; len(c) != 1 || c[0].Checkpoint == nil || c[0].Checkpoint.Name != "step-1" || !c[0].Checkpoint.Requested {
		t.Fatalf("checkpointed facts of ckpt = %+v, want one requested step-1", c)
	}
	if len(facts[contracts.RunStarted]) != 1 || len(facts[contracts.RunEnded]) != 1 {
		t.Fatalf("ckpt has %d started and %d ended facts, want one each", len(facts[contracts.RunStarted]), len(facts[contracts.RunEnded]))
	}
}

type logResult struct {
	body, exit, complete string
	err                  error
}

// getLogs reads a job's output from the gateway, trailers included.
func getLogs(ctx context.Context, gateway, job, query string) logResult {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, gateway+"/v1/tenants/acme/jobs/"+job+"/logs"+query, nil)
	if err != nil {
		return logResult{err: err}
	}
	resp, err := authClient.Do(req)
	if err != nil {
		return logResult{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return logResult{body: string(b), exit: resp.Trailer.Get(contracts.TrailerExitCode),
		complete: resp.Trailer.Get(contracts.TrailerLogComplete), err: err}
}

// placementOf is where the job's last attempt ran, from its run facts.
func placementOf(t *testing.T, s *stack, job string) contracts.Placement {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	started := runFacts(t, ctx, s, contracts.AllocationID("acme", job, 1))[contracts.RunStarted]
	if len(started) != 1 {
		t.Fatalf("%s has %d started facts, want 1", job, len(started))
	}
	return contracts.Placement{AllocationID: started[0].AllocationID, NodeID: started[0].NodeID, Devices: started[0].Devices}
}

// runFacts reads every run fact of one allocation from RUNS.
func runFacts(t testing.TB, ctx context.Context, s *stack, allocationID string) map[contracts.RunKind][]contracts.RunEvent {
	t.Helper()
	cons, err := s.js.OrderedConsumer(ctx, contracts.StreamRuns, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.js.Stream(ctx, contracts.StreamRuns)
	if err != nil {
		t.Fatal(err)
	}
	last := info.CachedInfo().State.LastSeq
	out := map[contracts.RunKind][]contracts.RunEvent{}
	for seq := uint64(0); seq < last; {
		m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatalf("reading RUNS: %v", err)
		}
		md, _ := m.Metadata()
		seq = md.Sequence.Stream
		var ev contracts.RunEvent
		if json.Unmarshal(m.Data(), &ev) == nil && ev.AllocationID == allocationID {
			out[ev.Kind] = append(out[ev.Kind], ev)
		}
	}
	return out
}
