package gpuplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// DefaultPageSize is the gateway's page of jobs when ListOptions.Limit is
// 0; MaxPageSize the largest it serves.
const (
	DefaultPageSize = 100
	MaxPageSize     = 1000
)

// Submit submits req for tenant. A request without an ID is given a new
// time-ordered one first (contracts.NewJobID), so every attempt of this
// call, and any later submit of the same ID, is the same job: the gateway
// answers a repeat with Duplicate set and starts nothing new. The job's
// outcome arrives as events (Watch, Wait).
func (c *Client) Submit(ctx context.Context, tenant string, req contracts.JobRequest) (contracts.SubmitResponse, error) {
	if req.ID == "" {
		req.ID = contracts.NewJobID()
	}
	body, err := jsonBody(req)
	if err != nil {
		return contracts.SubmitResponse{}, err
	}
	var res contracts.SubmitResponse
	err = c.call(ctx, request{method: http.MethodPost, path: tenantPath(tenant, "jobs"), body: body, idempotent: true}, &res)
	return res, err
}

// SubmitJSON submits a JobRequest document as it is (gpuctl sends the
// document a user wrote, after its own check). It is retried like Submit
// only when the document names its job ID: without one, each attempt
// would be a new job.
func (c *Client) SubmitJSON(ctx context.Context, tenant string, doc []byte) (contracts.SubmitResponse, error) {
	var head struct {
		ID string `json:"id"`
	}
	idempotent := json.Unmarshal(doc, &head) == nil && head.ID != ""
	var res contracts.SubmitResponse
	err := c.call(ctx, request{method: http.MethodPost, path: tenantPath(tenant, "jobs"), body: doc, idempotent: idempotent}, &res)
	return res, err
}

// Job is one job's status, as the gateway's read model folds its events.
func (c *Client) Job(ctx context.Context, tenant, id string) (contracts.JobStatus, error) {
	var st contracts.JobStatus
	err := c.call(ctx, request{method: http.MethodGet, path: tenantPath(tenant, "jobs", id), idempotent: true}, &st)
	return st, err
}

// DescribeJob is everything the gateway knows about one job: why it
// waits, where it runs, its events.
func (c *Client) DescribeJob(ctx context.Context, tenant, id string) (contracts.JobDescription, error) {
	var d contracts.JobDescription
	err := c.call(ctx, request{method: http.MethodGet, path: tenantPath(tenant, "jobs", id, "describe"), idempotent: true}, &d)
	return d, err
}

// CancelJob asks to cancel a job; reason is recorded with the request.
// Asking twice is asking once (the answer's Duplicate says so).
func (c *Client) CancelJob(ctx context.Context, tenant, id, reason string) (contracts.SubmitResponse, error) {
	var q url.Values
	if reason != "" {
		q = url.Values{"reason": {reason}}
	}
	var res contracts.SubmitResponse
	err := c.call(ctx, request{method: http.MethodDelete, path: tenantPath(tenant, "jobs", id), query: q, idempotent: true}, &res)
	return res, err
}

// CheckpointJob asks the job's running process to write a checkpoint
// (409 not_running or not_checkpointable otherwise). It is not retried:
// each request is one more checkpoint.
func (c *Client) CheckpointJob(ctx context.Context, tenant, id string) (contracts.CheckpointResponse, error) {
	var res contracts.CheckpointResponse
	err := c.call(ctx, request{method: http.MethodPost, path: tenantPath(tenant, "jobs", id, "checkpoint")}, &res)
	return res, err
}

// ListOptions select a page of jobs.
type ListOptions struct {
	// State keeps only jobs in this state; "" keeps all.
	State contracts.JobState
	// Limit is the page size (0: DefaultPageSize; at most MaxPageSize).
	Limit int
	// After is JobPage.Next of the previous page; "" for the first.
	After string
}

// JobPage is one page of a tenant's jobs, newest first.
type JobPage struct {
	Jobs []contracts.JobStatus
	// Next is the After of the next page; "" when this page is the last.
	Next string
}

// ListJobs is one page of the tenant's jobs, newest first (ties by ID).
// The cursor is a job, not an offset: jobs submitted between two pages
// are newer and shift nothing.
func (c *Client) ListJobs(ctx context.Context, tenant string, opts ListOptions) (JobPage, error) {
	q := url.Values{}
	if opts.State != "" {
		q.Set("state", string(opts.State))
	}
	if opts.Limit != 0 {
		q.Set("limit", strconv.Itoa(opts.Limit))
	}
	if opts.After != "" {
		q.Set("after", opts.After)
	}
	var list contracts.JobList
	if err := c.call(ctx, request{method: http.MethodGet, path: tenantPath(tenant, "jobs"), query: q, idempotent: true}, &list); err != nil {
		return JobPage{}, err
	}
	// A gateway that ignores ?after= would serve the first page forever.
	if opts.After != "" && slices.ContainsFunc(list.Jobs, func(j contracts.JobStatus) bool { return j.JobID == opts.After }) {
		return JobPage{}, errors.New("the gateway ignores ?after= (it predates paging): upgrade it, or list with one page of up to 1000 jobs")
	}
	page := JobPage{Jobs: list.Jobs}
	size := opts.Limit
	if size == 0 {
		size = DefaultPageSize
	}
	// A full page may have more behind it; a short one is the last.
	if len(list.Jobs) >= size && len(list.Jobs) > 0 {
		page.Next = list.Jobs[len(list.Jobs)-1].JobID
	}
	return page, nil
}

// Jobs iterates over every job of the tenant that opts selects, newest
// first, fetching page after page (opts.Limit jobs each) as it goes. An
// error ends the iteration, as its last pair.
func (c *Client) Jobs(ctx context.Context, tenant string, opts ListOptions) iter.Seq2[contracts.JobStatus, error] {
	return func(yield func(contracts.JobStatus, error) bool) {
		for {
			page, err := c.ListJobs(ctx, tenant, opts)
			if err != nil {
				yield(contracts.JobStatus{}, err)
				return
			}
			for _, j := range page.Jobs {
				if !yield(j, nil) {
					return
				}
			}
			if page.Next == "" {
				return
			}
			opts.After = page.Next
		}
	}
}

// Usage is the tenant's metered GPU usage and its cost.
func (c *Client) Usage(ctx context.Context, tenant string) (contracts.UsageSummary, error) {
	var sum contracts.UsageSummary
	err := c.call(ctx, request{method: http.MethodGet, path: tenantPath(tenant, "usage"), idempotent: true}, &sum)
	return sum, err
}

// Wait watches the job until it ends and returns its final status (the
// read model's, once it has caught up with the terminal event). Whether
// the job succeeded is the status's State.
func (c *Client) Wait(ctx context.Context, tenant, id string) (contracts.JobStatus, error) {
	var last Event
	for ev, err := range c.Watch(ctx, tenant, id, WatchOptions{}) {
		if err != nil {
			return contracts.JobStatus{}, err
		}
		last = ev
	}
	if last.Seq == 0 {
		return contracts.JobStatus{}, fmt.Errorf("job %s/%s: the event stream ended without events", tenant, id)
	}
	// The read model folds the same events, maybe a moment later.
	for {
		st, err := c.Job(ctx, tenant, id)
		if err != nil {
			return st, err
		}
		if st.State.Terminal() {
			return st, nil
		}
		if err := sleepCtx(ctx, 100*time.Millisecond); err != nil {
			return st, err
		}
	}
}
