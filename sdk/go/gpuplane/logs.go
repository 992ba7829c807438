package gpuplane

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// LogOptions select the output Logs reads.
type LogOptions struct {
	// Attempt is the attempt whose output to read, from 1; 0 is the
	// latest. AllAttempts reads every attempt in order instead.
	Attempt     int
	AllAttempts bool
	// Rank is the machine of a multi-machine job whose output to read,
	// from 0 (a single-machine job has only 0).
	Rank int
	// Follow goes on as the run writes, until the attempt ends: a job not
	// started yet is waited for, and so is one just submitted that the
	// gateway does not know yet (up to JobAppearTimeout).
	Follow bool
}

// LogStream is a run's output as it arrives: read it to the end (io.EOF),
// then Complete, ExitCode and Gaps say what only the end knows. Close it.
type LogStream struct {
	res *http.Response
}

// Read reads the output.
func (l *LogStream) Read(p []byte) (int, error) { return l.res.Body.Read(p) }

// Close ends the stream (a follow included).
func (l *LogStream) Close() error { return l.res.Body.Close() }

// Attempt is the attempt shown: "1", "2", ... or "all".
func (l *LogStream) Attempt() string { return l.res.Header.Get(contracts.HeaderLogAttempt) }

// Complete reports, after the end of the stream, whether the output ended
// with its end-of-output mark: false for a follow cut short (the run's
// machine died, the gateway shut down) and for a run not ended yet.
func (l *LogStream) Complete() bool { return l.res.Trailer.Get(contracts.TrailerLogComplete) == "true" }

// ExitCode is, after the end of the stream, the exit code of the run
// shown, if it ended.
func (l *LogStream) ExitCode() (int, bool) {
	n, err := strconv.Atoi(l.res.Trailer.Get(contracts.TrailerExitCode))
	return n, err == nil
}

// Gaps is, after the end of the stream, the byte ranges of output that
// never arrived ("attempt 1: 100-200"), "" when none.
func (l *LogStream) Gaps() string { return l.res.Trailer.Get(contracts.TrailerLogGaps) }

// Logs opens the output of a job's run (text). Without Follow it is what
// has arrived so far; with Follow the stream lasts until the attempt
// ends, so ctx, not a timeout, bounds it.
func (c *Client) Logs(ctx context.Context, tenant, id string, opts LogOptions) (*LogStream, error) {
	q := url.Values{}
	switch {
	case opts.AllAttempts:
		q.Set("attempt", "all")
	case opts.Attempt > 0:
		q.Set("attempt", strconv.Itoa(opts.Attempt))
	}
	if opts.Rank != 0 {
		q.Set("rank", strconv.Itoa(opts.Rank))
	}
	if opts.Follow {
		q.Set("follow", "true")
	}
	r := request{method: http.MethodGet, path: tenantPath(tenant, "jobs", id, "logs"), query: q,
		header: http.Header{"Accept": {"text/plain"}}, idempotent: true, stream: true}
	res, err := c.do(ctx, r)
	// A job submitted a moment ago is not in the gateway's read model
	// until the scheduler has queued it: a follow waits for it too, a
	// little (a mistyped ID is still an error).
	for deadline, wait := time.Now().Add(JobAppearTimeout), 50*time.Millisecond; opts.Follow && ReasonOf(err) == contracts.ReasonUnknownJob && time.Now().Before(deadline); wait = min(2*wait, time.Second) {
		if serr := sleepCtx(ctx, wait); serr != nil {
			return nil, err
		}
		res, err = c.do(ctx, r)
	}
	if err != nil {
		return nil, err
	}
	return &LogStream{res: res}, nil
}

// JobAppearTimeout is how long a follow of a job the gateway does not know
// waits for it to appear (a submit the scheduler has not queued yet).
const JobAppearTimeout = 10 * time.Second

// ReadLogs is the output of a run so far (no follow), read whole.
func (c *Client) ReadLogs(ctx context.Context, tenant, id string, opts LogOptions) (string, error) {
	opts.Follow = false
	l, err := c.Logs(ctx, tenant, id, opts)
	if err != nil {
		return "", err
	}
	defer l.Close()
	data, err := io.ReadAll(io.LimitReader(l, maxAnswer))
	return string(data), err
}
