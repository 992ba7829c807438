package gpuctl

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/gpuplane/gpuplane/contracts"
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
		q := url.Values{}
		if attempt != "" {
			q.Set("attempt", attempt)
		}
		rankSet := false
		fs.Visit(func(f *flag.Flag) { rankSet = rankSet || f.Name == "rank" })
		if rankSet {
			q.Set("rank", strconv.Itoa(rank))
		}
		if follow {
			q.Set("follow", "true")
		}
		return a.logs(ctx, id, q, follow)
	}
}

// logs copies the run's output to stdout as it arrives, then reports on
// stderr what the trailers say: missing ranges and the exit code (of the
// machine asked for with q's rank, when it names one). It
// fails when the stream breaks, or when a follow ends without the end of
// the output (the run's machine died, the gateway shut down).
func (a *app) logs(ctx context.Context, id string, q url.Values, follow bool) int {
	// No request timeout: a follow lasts as long as the run.
	res, err := a.newClient().send(ctx, http.MethodGet, tenantPath(a.tenant, "jobs", id, "logs"), q, nil,
		http.Header{"Accept": {"text/plain"}})
	if err != nil {
		return a.fail("logs", err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		data, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
		return a.fail("logs", answerError(res.StatusCode, data))
	}
	if _, err := io.Copy(a.stdout, res.Body); err != nil {
		if ctx.Err() != nil {
			return a.fail("logs", ctx.Err())
		}
		return a.fail("logs", fmt.Errorf("output stream broken: %w", err))
	}
	shown := res.Header.Get(contracts.HeaderLogAttempt)
	if gaps := res.Trailer.Get(contracts.TrailerLogGaps); gaps != "" {
		fmt.Fprintf(a.stderr, "gpuctl logs: output never received, by byte range: %s\n", gaps)
	}
	if code := res.Trailer.Get(contracts.TrailerExitCode); code != "" {
		what := "the run"
		if n, err := strconv.Atoi(shown); err == nil {
			what = fmt.Sprintf("attempt %d", n)
		}
		if r := q.Get("rank"); r != "" {
			what += " on rank " + r
		}
		fmt.Fprintf(a.stderr, "gpuctl logs: %s exited with code %s\n", what, code)
	}
	if follow && res.Trailer.Get(contracts.TrailerLogComplete) != "true" {
		return a.fail("logs", errors.New("the output ended without its end-of-output mark: the run was lost (its node died), never started, or the gateway shut down"))
	}
	return ExitOK
}
