package gateway

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	natssrv "github.com/nats-io/nats-server/v2/server"

	"github.com/gpuplane/gpuplane/contracts"
)

// logAnswer is a logs response read to its end, trailers included.
type logAnswer struct {
	status  int
	body    string
	header  http.Header
	trailer http.Header
}

// getLogs reads GET path to its end.
func (h *harness) getLogs(path string) logAnswer {
	h.t.Helper()
	res := h.openLogs(path)
	defer res.Body.Close()
	data, err := io.ReadAll(res.Body)
	if err != nil {
		h.t.Fatalf("GET %s: read body: %v", path, err)
	}
	return logAnswer{status: res.StatusCode, body: string(data), header: res.Header, trailer: res.Trailer}
}

func (h *harness) openLogs(path string) *http.Response {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	h.t.Cleanup(cancel)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.url+path, nil)
	if err != nil {
		h.t.Fatal(err)
	}
	res, err := h.hc.Do(req)
	if err != nil {
		h.t.Fatalf("GET %s: %v", path, err)
	}
	return res
}

// publishChunk publishes a chunk of the output of attempt of acme/job as
// the node agent does. msgID overrides the Nats-Msg-Id, so a test can
// store a repeat that JetStream would otherwise drop (a republish after
// the duplicate window).
func (h *harness) publishChunk(job string, attempt int, off int64, data string, eof bool, exit int, msgID ...string) {
	h.t.Helper()
	h.publishRunChunk(contracts.AllocationID("acme", job, attempt), job, attempt, off, data, eof, exit, msgID...)
}

// publishPartChunk publishes a chunk of the output of machine rank of a
// gang's attempt: its own allocation ID and byte offsets.
func (h *harness) publishPartChunk(job string, attempt, rank int, off int64, data string, eof bool, exit int) {
	h.t.Helper()
	h.publishRunChunk(contracts.AllocationPartID("acme", job, attempt, rank), job, attempt, off, data, eof, exit)
}

func (h *harness) publishRunChunk(alloc, job string, attempt int, off int64, data string, eof bool, exit int, msgID ...string) {
	h.t.Helper()
	c := contracts.LogChunk{SchemaVersion: contracts.SchemaVersion, AllocationID: alloc, Tenant: "acme", JobID: job,
		Attempt: attempt, NodeID: "node-1", Offset: off, Data: data, EOF: eof, ExitCode: exit, Time: time.Now()}
	id := contracts.LogChunkID(alloc, off, eof)
	if len(msgID) > 0 {
		id = msgID[0]
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if _, err := h.bus.Publish(ctx, contracts.SubjectLogs("acme", job, "n1"), id, c); err != nil {
		h.t.Fatalf("publish chunk: %v", err)
	}
}

// runJob publishes the events of acme/job up to running attempt 1 (at
// times around at) and waits until the gateway knows it runs.
func (h *harness) runJob(job string, at time.Time, edit ...func(*contracts.JobEvent)) {
	h.t.Helper()
	q := queued("acme", job, at)
	for _, e := range edit {
		e(&q)
	}
	h.publishEvent(q)
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme", JobID: job, Attempt: 1, Time: at,
		Placement: &contracts.Placement{AllocationID: contracts.AllocationID("acme", job, 1), NodeID: "node-1", Pool: "h100",
			Devices: []contracts.DeviceRef{{Index: 0, UUID: "GPU-0", Model: "H100-80GB"}}}})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: job, Attempt: 1, Time: at, StartedAt: &at})
	h.waitState(job, contracts.StateRunning, 1)
}

func (h *harness) waitState(job string, state contracts.JobState, attempt int) {
	h.t.Helper()
	h.eventually("job "+job+" "+string(state), func() bool {
		var st contracts.JobStatus
		status, _ := h.do(http.MethodGet, "/v1/tenants/acme/jobs/"+job, "", &st)
		return status == http.StatusOK && st.State == state && st.Attempt == attempt
	})
}

func logsPath(job, query string) string {
	p := "/v1/tenants/acme/jobs/" + job + "/logs"
	if query != "" {
		p += "?" + query
	}
	return p
}

// TestLogsReassembleChunks publishes a run's chunks out of order, repeated
// and re-cut at other boundaries: the answer is the exact output, with
// the exit code and completeness in trailers.
func TestLogsReassembleChunks(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.runJob("j1", time.Now())
	h.publishChunk("j1", 1, 6, "world\n", false, 0)
	h.publishChunk("j1", 1, 0, "hello ", false, 0)
	h.publishChunk("j1", 1, 6, "world\n", false, 0, "repeat-1") // the same chunk again
	h.publishChunk("j1", 1, 9, "ld\nbye\n", false, 0)           // re-cut: overlaps the last one
	h.publishChunk("j1", 1, 0, "hello ", false, 0, "repeat-2")  // the first chunk again, late
	h.publishChunk("j1", 1, 16, "", true, 3)                    // EOF, exit code 3
	h.publishChunk("j1", 1, 16, "", true, 3, "repeat-eof")      // and its repeat
	h.publishChunk("other", 1, 0, "not this job\n", false, 0)   // another job's subject
	got := h.getLogs(logsPath("j1", ""))
	if got.status != http.StatusOK || got.body != "hello world\nbye\n" {
		t.Fatalf("GET logs: %d %q, want 200 %q", got.status, got.body, "hello world\nbye\n")
	}
	if ct := got.header.Get("Content-Type"); ct != "text/plain; charset=utf-8" {
		t.Errorf("Content-Type %q", ct)
	}
	if got.header.Get(contracts.HeaderLogAttempt) != "1" || got.trailer.Get(contracts.TrailerLogComplete) != "true" ||
		got.trailer.Get(contracts.TrailerExitCode) != "3" || got.trailer.Get(contracts.TrailerLogGaps) != "" {
		t.Fatalf("header %v trailer %v; want attempt 1, complete, exit code 3, no gaps", got.header, got.trailer)
	}
}

func TestLogsNoteGaps(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.runJob("j1", time.Now())
	h.publishChunk("j1", 1, 0, "abc", false, 0)
	h.publishChunk("j1", 1, 6, "ghi", false, 0) // 3-6 never comes
	h.publishChunk("j1", 1, 9, "", true, 0)
	got := h.getLogs(logsPath("j1", ""))
	if got.body != "abcghi" || got.trailer.Get(contracts.TrailerLogGaps) != "attempt 1: 3-6" ||
		got.trailer.Get(contracts.TrailerLogComplete) != "true" {
		t.Fatalf("body %q trailer %v; want abcghi with the gap 3-6 noted", got.body, got.trailer)
	}
}

// TestLogsAttemptSelection: a job ran twice; the latest attempt is the
// default, any other can be asked for, or all in order.
func TestLogsAttemptSelection(t *testing.T) {
	h := startGateway(t, nil, nil)
	now := time.Now()
	h.runJob("j1", now)
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRequeued, Tenant: "acme", JobID: "j1", Attempt: 2, Time: now, Reason: contracts.ReasonNodeLost})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme", JobID: "j1", Attempt: 2, Time: now,
		Placement: &contracts.Placement{AllocationID: contracts.AllocationID("acme", "j1", 2), NodeID: "node-2", Pool: "h100",
			Devices: []contracts.DeviceRef{{Index: 0, UUID: "GPU-0", Model: "H100-80GB"}}}})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: "j1", Attempt: 2, Time: now})
	h.waitState("j1", contracts.StateRunning, 2)
	// Attempt 2's output is published first: the stream order must not
	// decide the order of attempts.
	h.publishChunk("j1", 2, 0, "second\n", false, 0)
	h.publishChunk("j1", 1, 0, "first\n", false, 0)
	h.publishChunk("j1", 1, 6, "", true, 137)

	for query, want := range map[string]struct {
		body, attempt, complete, exit string
	}{
		"":                      {"second\n", "2", "false", ""},
		"attempt=latest":        {"second\n", "2", "false", ""},
		"attempt=2":             {"second\n", "2", "false", ""},
		"attempt=1":             {"first\n", "1", "true", "137"},
		"attempt=all":           {"first\nsecond\n", "all", "false", ""},
		"attempt=1&follow=true": {"first\n", "1", "true", "137"}, // attempt 1 has ended: follow ends at once
	} {
		got := h.getLogs(logsPath("j1", query))
		if got.status != http.StatusOK || got.body != want.body || got.header.Get(contracts.HeaderLogAttempt) != want.attempt ||
			got.trailer.Get(contracts.TrailerLogComplete) != want.complete || got.trailer.Get(contracts.TrailerExitCode) != want.exit {
			t.Errorf("?%s: %d %q attempt %q trailer %v; want %q attempt %s complete %s exit %q", query, got.status, got.body,
				got.header.Get(contracts.HeaderLogAttempt), got.trailer, want.body, want.attempt, want.complete, want.exit)
		}
	}
	for query, want := range map[string]contracts.Reason{
		"attempt=3":      contracts.ReasonOutOfRange,
		"attempt=0":      contracts.ReasonInvalidValue,
		"attempt=first":  contracts.ReasonInvalidValue,
		"follow=perhaps": contracts.ReasonInvalidValue,
	} {
		var apiErr contracts.APIError
		if status, body := h.do(http.MethodGet, logsPath("j1", query), "", &apiErr); status != 400 || apiErr.Error.Reason != want ||
			len(apiErr.Error.Fields) != 1 {
			t.Errorf("?%s: %d %s, want 400 %s with one field", query, status, body, want)
		}
	}
}

func TestLogsOfUnknownAndUnstartedJobs(t *testing.T) {
	h := startGateway(t, nil, nil)
	var apiErr contracts.APIError
	if status, body := h.do(http.MethodGet, logsPath("ghost", ""), "", &apiErr); status != 404 || apiErr.Error.Reason != contracts.ReasonUnknownJob {
		t.Fatalf("logs of an unknown job: %d %s, want 404 unknown_job", status, body)
	}
	if status, body := h.do(http.MethodGet, "/v1/tenants/acme/jobs/a.b/logs", "", &apiErr); status != 400 || apiErr.Error.Reason != contracts.ReasonInvalidID {
		t.Fatalf("logs of a bad job ID: %d %s, want 400 invalid_id", status, body)
	}
	h.publishEvent(queued("acme", "waiting", time.Now()))
	h.waitState("waiting", contracts.StateQueued, 1)
	got := h.getLogs(logsPath("waiting", ""))
	if got.status != http.StatusOK || got.body != "" || got.trailer.Get(contracts.TrailerLogComplete) != "false" {
		t.Fatalf("logs of a queued job: %d %q trailer %v, want 200, empty, not complete", got.status, got.body, got.trailer)
	}
}

// readUntil reads from r until the text read so far ends with want.
func readUntil(t *testing.T, r *bufio.Reader, want string) string {
	t.Helper()
	var b strings.Builder
	for !strings.HasSuffix(b.String(), want) {
		c, err := r.ReadByte()
		if err != nil {
			t.Fatalf("read %q so far, waiting for %q: %v", b.String(), want, err)
		}
		b.WriteByte(c)
	}
	return b.String()
}

// TestLogsFollow starts following a job that has not started, then the
// run writes: each chunk arrives while the request is open, and the
// answer ends by itself at the EOF chunk.
func TestLogsFollow(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.publishEvent(queued("acme", "j1", time.Now()))
	h.waitState("j1", contracts.StateQueued, 1)
	res := h.openLogs(logsPath("j1", "follow=true"))
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("follow: status %d", res.StatusCode)
	}
	rd := bufio.NewReader(res.Body)

	h.runJob("j1", time.Now())
	h.publishChunk("j1", 1, 0, "step 1\n", false, 0)
	if got := readUntil(t, rd, "\n"); got != "step 1\n" {
		t.Fatalf("first line %q", got)
	}
	h.publishChunk("j1", 1, 14, "step 3\n", false, 0) // ahead of its turn: held back
	h.publishChunk("j1", 1, 7, "step 2\n", false, 0)
	if got := readUntil(t, rd, "step 3\n"); got != "step 2\nstep 3\n" {
		t.Fatalf("next lines %q", got)
	}
	h.publishChunk("j1", 1, 21, "done\n", true, 0)
	rest, err := io.ReadAll(rd)
	if err != nil || string(rest) != "done\n" {
		t.Fatalf("rest %q, %v; want the EOF chunk's data and the end", rest, err)
	}
	if res.Trailer.Get(contracts.TrailerLogComplete) != "true" || res.Trailer.Get(contracts.TrailerExitCode) != "0" {
		t.Fatalf("trailer %v, want complete with exit code 0", res.Trailer)
	}
}

// TestLogsFollowAllAttempts follows every attempt: the first one's output
// (ended), then the second's as it is written, to its EOF.
func TestLogsFollowAllAttempts(t *testing.T) {
	h := startGateway(t, nil, nil)
	// Attempt 1 was requeued a while ago: no grace to wait for its EOF.
	then := time.Now().Add(-time.Minute)
	h.runJob("j1", then)
	h.publishChunk("j1", 1, 0, "one\n", false, 0)
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRequeued, Tenant: "acme", JobID: "j1", Attempt: 2, Time: then})
	h.waitState("j1", contracts.StateQueued, 2)
	res := h.openLogs(logsPath("j1", "attempt=all&follow=true"))
	defer res.Body.Close()
	rd := bufio.NewReader(res.Body)
	// Attempt 1 has no EOF (its node was lost): it is written as it is.
	h.publishChunk("j1", 2, 0, "two\n", false, 0)
	if got := readUntil(t, rd, "two\n"); got != "one\ntwo\n" {
		t.Fatalf("read %q, want one then two", got)
	}
	h.publishChunk("j1", 2, 4, "", true, 0)
	if rest, err := io.ReadAll(rd); err != nil || len(rest) != 0 {
		t.Fatalf("rest %q, %v; want the end", rest, err)
	}
	if res.Trailer.Get(contracts.TrailerLogComplete) != "true" {
		t.Fatalf("trailer %v, want complete", res.Trailer)
	}
}

// TestLogsFollowEndsWithoutEOF: the job ended long ago and its run never
// sent an EOF (its machine died): following ends once the history is
// read, saying the output is incomplete.
func TestLogsFollowEndsWithoutEOF(t *testing.T) {
	h := startGateway(t, nil, nil)
	long := time.Now().Add(-time.Hour)
	h.runJob("j1", long)
	h.publishChunk("j1", 1, 0, "partial", false, 0)
	h.publishEvent(contracts.JobEvent{Type: contracts.EventFailed, Tenant: "acme", JobID: "j1", Attempt: 1, Time: long, Reason: contracts.ReasonNodeLost})
	h.waitState("j1", contracts.StateFailed, 1)
	got := h.getLogs(logsPath("j1", "follow=true"))
	if got.body != "partial" || got.trailer.Get(contracts.TrailerLogComplete) != "false" || got.trailer.Get(contracts.TrailerExitCode) != "" {
		t.Fatalf("body %q trailer %v; want the partial output, not complete, no exit code", got.body, got.trailer)
	}
}

// gatewaySubs is the number of subscriptions of the gateway's own NATS
// connection (the server keeps consumers' internal ones a while longer).
func (h *harness) gatewaySubs() uint32 {
	h.t.Helper()
	cz, err := h.nats.Connz(&natssrv.ConnzOptions{Subscriptions: true})
	if err != nil {
		h.t.Fatal(err)
	}
	for _, c := range cz.Conns {
		if c.Name == Name {
			return c.NumSubs
		}
	}
	h.t.Fatalf("no connection named %s", Name)
	return 0
}

// TestLogsFollowEndsWhenClientLeaves: a follow of a running job reads
// the stream through a subscription of the gateway; the client going away
// ends the handler, and with it the subscription.
func TestLogsFollowEndsWhenClientLeaves(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.runJob("j1", time.Now())
	h.publishChunk("j1", 1, 0, "x", false, 0)
	idle := h.gatewaySubs()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.url+logsPath("j1", "follow=true"), nil)
	if err != nil {
		t.Fatal(err)
	}
	res, err := h.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if got := readUntil(t, bufio.NewReader(res.Body), "x"); got != "x" {
		t.Fatalf("read %q", got)
	}
	if n := h.gatewaySubs(); n <= idle {
		t.Fatalf("%d subscriptions while following, %d before: the follow reads nothing?", n, idle)
	}
	cancel()
	h.eventually("the follow's subscription gone", func() bool { return h.gatewaySubs() == idle })
}

// scheduleGang publishes the events that put attempt of acme/job on two
// machines, one placement per rank, and waits until it runs.
func (h *harness) scheduleGang(job string, attempt int, at time.Time) {
	h.t.Helper()
	var parts []contracts.Placement
	for rank := range 2 {
		parts = append(parts, contracts.Placement{AllocationID: contracts.AllocationPartID("acme", job, attempt, rank),
			NodeID: "node-" + strconv.Itoa(rank+1), Pool: "h100", Devices: []contracts.DeviceRef{{Index: 0, UUID: "GPU-0", Model: "H100-80GB"}}})
	}
	h.publishEvent(contracts.JobEvent{Type: contracts.EventScheduled, Tenant: "acme", JobID: job, Attempt: attempt, Time: at,
		Placement: &parts[0], Placements: parts})
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRunning, Tenant: "acme", JobID: job, Attempt: attempt, Time: at, StartedAt: &at})
	h.waitState(job, contracts.StateRunning, attempt)
}

// logCase is what one logs request should answer.
type logCase struct {
	body, attempt, complete, exit string
}

func (h *harness) checkLogs(job string, cases map[string]logCase) {
	h.t.Helper()
	for query, want := range cases {
		got := h.getLogs(logsPath(job, query))
		if got.status != http.StatusOK || got.body != want.body || got.header.Get(contracts.HeaderLogAttempt) != want.attempt ||
			got.trailer.Get(contracts.TrailerLogComplete) != want.complete || got.trailer.Get(contracts.TrailerExitCode) != want.exit {
			h.t.Errorf("?%s: %d %q attempt %q trailer %v; want %q attempt %s complete %s exit %q", query, got.status, got.body,
				got.header.Get(contracts.HeaderLogAttempt), got.trailer, want.body, want.attempt, want.complete, want.exit)
		}
	}
}

// TestLogsGangRanks: a job on two machines has one output per machine,
// each with its own offsets and EOF; ?rank=N shows one, rank 0 by
// default, in replay and follow, attempt by attempt.
func TestLogsGangRanks(t *testing.T) {
	h := startGateway(t, nil, nil)
	now := time.Now()
	q := queued("acme", "g", now)
	q.Request.Resources.GPU.Nodes = 2
	h.publishEvent(q)
	h.scheduleGang("g", 1, now)
	// The machines write at the same offsets, interleaved on the subject.
	h.publishPartChunk("g", 1, 1, 0, "r1 a\n", false, 0)
	h.publishPartChunk("g", 1, 0, 0, "r0 a\n", false, 0)
	h.publishPartChunk("g", 1, 0, 5, "", true, 0)
	h.publishChunk("g", 1, 0, "no part named\n", false, 0) // a plain allocation ID is no part of a gang
	h.checkLogs("g", map[string]logCase{
		"":       {"r0 a\n", "1", "true", "0"},
		"rank=0": {"r0 a\n", "1", "true", "0"},
		"rank=1": {"r1 a\n", "1", "false", ""},
	})

	// Following rank 1: its own EOF ends the answer, not rank 0's.
	res := h.openLogs(logsPath("g", "rank=1&follow=true"))
	defer res.Body.Close()
	rd := bufio.NewReader(res.Body)
	if got := readUntil(t, rd, "\n"); got != "r1 a\n" {
		t.Fatalf("rank 1 so far %q", got)
	}
	// Rank 0's EOF again (a republish): not rank 1's end.
	h.publishRunChunk(contracts.AllocationPartID("acme", "g", 1, 0), "g", 1, 5, "", true, 0, "repeat-rank-0-eof")
	h.publishPartChunk("g", 1, 1, 5, "r1 b\n", false, 0)
	if got := readUntil(t, rd, "\n"); got != "r1 b\n" {
		t.Fatalf("rank 1 next %q", got)
	}
	h.publishPartChunk("g", 1, 1, 10, "", true, 7)
	if rest, err := io.ReadAll(rd); err != nil || len(rest) != 0 {
		t.Fatalf("rest %q, %v; want the end", rest, err)
	}
	if res.Trailer.Get(contracts.TrailerLogComplete) != "true" || res.Trailer.Get(contracts.TrailerExitCode) != "7" {
		t.Fatalf("rank 1 trailer %v, want complete with exit code 7", res.Trailer)
	}

	// Attempt 2, on two machines again: attempts are chosen per rank.
	h.publishEvent(contracts.JobEvent{Type: contracts.EventRequeued, Tenant: "acme", JobID: "g", Attempt: 2, Time: now, Reason: contracts.ReasonNodeLost})
	h.scheduleGang("g", 2, now)
	h.publishPartChunk("g", 2, 1, 0, "r1 again\n", false, 0)
	h.publishPartChunk("g", 2, 1, 9, "", true, 0)
	h.publishPartChunk("g", 2, 0, 0, "r0 again\n", false, 0)
	h.checkLogs("g", map[string]logCase{
		"":                             {"r0 again\n", "2", "false", ""},
		"attempt=all":                  {"r0 a\nr0 again\n", "all", "false", ""},
		"rank=1":                       {"r1 again\n", "2", "true", "0"},
		"rank=1&attempt=1":             {"r1 a\nr1 b\n", "1", "true", "7"},
		"rank=1&attempt=all":           {"r1 a\nr1 b\nr1 again\n", "all", "true", "0"},
		"rank=1&attempt=1&follow=true": {"r1 a\nr1 b\n", "1", "true", "7"},
	})
}

// TestLogsBadRank: a rank that is no number, or names no machine of the
// job, is refused with the field it is about.
func TestLogsBadRank(t *testing.T) {
	h := startGateway(t, nil, nil)
	h.runJob("single", time.Now())
	q := queued("acme", "g", time.Now())
	q.Request.Resources.GPU.Nodes = 2
	h.publishEvent(q)
	h.waitState("g", contracts.StateQueued, 1)
	h.checkLogs("single", map[string]logCase{"rank=0": {"", "1", "false", ""}})
	for query, want := range map[string]struct {
		job    string
		reason contracts.Reason
	}{
		"rank=-1":  {"g", contracts.ReasonInvalidValue},
		"rank=one": {"g", contracts.ReasonInvalidValue},
		"rank=128": {"g", contracts.ReasonInvalidValue},
		"rank=2":   {"g", contracts.ReasonOutOfRange},
		"rank=1":   {"single", contracts.ReasonOutOfRange},
	} {
		var apiErr contracts.APIError
		status, body := h.do(http.MethodGet, logsPath(want.job, query), "", &apiErr)
		if status != http.StatusBadRequest || apiErr.Error.Reason != want.reason || len(apiErr.Error.Fields) != 1 ||
			apiErr.Error.Fields[0].Field != "rank" {
			t.Errorf("%s ?%s: %d %s, want 400 %s on the field rank", want.job, query, status, body, want.reason)
		}
	}
}
