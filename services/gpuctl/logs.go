package gpuctl

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

func (a *app) logsCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var follow bool
	var attempt string
	var rank int
	fs.BoolVar(&follow, "f", false, "follow: keep printing as the run writes, until it ends")
	fs.BoolVar(&follow, "follow", false, "same as -f")
	fs.StringVar(&attempt, "attempt", "", "attempt to show: a number, latest (default) or all (every attempt in order)")
	fs.IntVar(&rank, "rank", 0, "machine of a multi-machine job whose output to show, from 0 (a single-machine job has only 0)")
	return func(ctx context.Context, pos, trailing []string) int {
		id, ok := a.onePositional("logs", pos, trailing)
		if !ok {
			return ExitUsage
		}
		if err := checkNames(a.tenant, id); err != nil {
			return a.usageErr("logs", "%v", err)
		}
		if attempt != "" && attempt != "all" && attempt != "latest" {
			if n, err := strconv.Atoi(attempt); err != nil || n < 1 {
				return a.usageErr("logs", "--attempt %q: want a number from 1, latest or all", attempt)
			}
		}
		// Whether the job has a machine of that rank only the gateway
		// knows; gpuctl refuses what no job can have.
		if rank < 0 || rank >= contracts.MaxNodesPerJob {
			return a.usageErr("logs", "--rank %d: want a machine's rank, a number from 0 to %d", rank, contracts.MaxNodesPerJob-1)
		}
		opts := gpuplane.LogOptions{Rank: rank, Follow: follow, AllAttempts: attempt == "all"}
		if n, err := strconv.Atoi(attempt); err == nil {
			opts.Attempt = n
		}
		rankSet := false
		fs.Visit(func(f *flag.Flag) { rankSet = rankSet || f.Name == "rank" })
		return a.logs(ctx, id, opts, rankSet)
	}
}

// logs copies the run's output to stdout as it arrives, then reports on
// stderr what the trailers say: missing ranges and the exit code (of the
// machine asked for, when --rank named one). It fails when the stream
// breaks, or when a follow ends without the end of the output (the run's
// machine died, the gateway shut down). No output at all is said on
// stderr, with the job's state, rather than printed as nothing.
func (a *app) logs(ctx context.Context, id string, opts gpuplane.LogOptions, rankSet bool) int {
	c, err := a.api()
	if err != nil {
		return a.fail("logs", err)
	}
	if opts.Follow {
		// The gateway waits for a job not started yet: say so, or the
		// wait looks like a hang.
		if st, err := c.Job(ctx, a.tenant, id); err == nil && notStarted(st.State) {
			fmt.Fprintf(a.stderr, "gpuctl logs: job %s is %s: waiting for its output\n", id, st.State)
		}
	}
	// No request timeout: a follow lasts as long as the run.
	l, err := c.Logs(ctx, a.tenant, id, opts)
	if err != nil {
		return a.fail("logs", err)
	}
	defer l.Close()
	n, err := io.Copy(a.stdout, l)
	if err != nil {
		if ctx.Err() != nil {
			return a.fail("logs", ctx.Err())
		}
		return a.fail("logs", fmt.Errorf("output stream broken: %w", err))
	}
	if n == 0 {
		a.noOutput(ctx, c, id)
	}
	if gaps := l.Gaps(); gaps != "" {
		fmt.Fprintf(a.stderr, "gpuctl logs: output never received, by byte range: %s\n", gaps)
	}
	if code, ok := l.ExitCode(); ok {
		what := "the run"
		if n, err := strconv.Atoi(l.Attempt()); err == nil {
			what = fmt.Sprintf("attempt %d", n)
		}
		if rankSet {
			what += " on rank " + strconv.Itoa(opts.Rank)
		}
		fmt.Fprintf(a.stderr, "gpuctl logs: %s exited with code %d\n", what, code)
	}
	if opts.Follow && !l.Complete() {
		return a.fail("logs", errors.New("the output ended without its end-of-output mark: the run was lost (its node died), never started, or the gateway shut down"))
	}
	return ExitOK
}

// notStarted: the job has not run yet, so it has no output yet.
func notStarted(s contracts.JobState) bool {
	return s == contracts.StateNew || s == contracts.StateQueued || s == contracts.StateScheduled
}

// noOutput says on stderr why nothing was printed: the job has not
// written anything yet, or it ended without writing anything.
func (a *app) noOutput(ctx context.Context, c *gpuplane.Client, id string) {
	st, err := c.Job(ctx, a.tenant, id)
	switch {
	case err != nil:
		fmt.Fprintf(a.stderr, "gpuctl logs: no output for job %s\n", id)
	case st.State.Terminal():
		fmt.Fprintf(a.stderr, "gpuctl logs: job %s wrote no output (state %s)\n", id, st.State)
	default:
		fmt.Fprintf(a.stderr, "gpuctl logs: no output yet for job %s (state %s)\n", id, st.State)
	}
}
