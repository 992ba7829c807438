package gpuplane

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// DefaultMaxReconnects is how many times in a row a watch reconnects to a
// broken event stream without receiving an event before it gives up.
const DefaultMaxReconnects = 5

// Event is one job event of an event stream.
type Event struct {
	// Seq is the event's JOB_EVENTS stream sequence: the SSE id, and the
	// After that resumes a watch behind it.
	Seq uint64
	// Event is the decoded job event.
	Event contracts.JobEvent
	// Raw is the event as the gateway sent it (JSON).
	Raw json.RawMessage
}

// WatchOptions tune Watch and WatchTenant.
type WatchOptions struct {
	// After resumes behind this stream sequence (an Event's Seq): the
	// events up to it are not sent again. 0 starts at the first.
	After uint64
	// MaxReconnects bounds the reconnects in a row that bring no event
	// (0: DefaultMaxReconnects; negative: never reconnect).
	MaxReconnects int
}

// Watch follows one job's events, its history first, and ends after the
// event that makes the job terminal (succeeded, failed, cancelled or
// rejected). When the connection breaks before that, it reconnects with
// Last-Event-ID set to the last event received, waiting a little longer
// each time, so the sequence it yields has no gap and no repeat. Events
// the job's state machine refuses (a rejected duplicate submit of an
// accepted job) are not the job's story and are not sent.
//
// An error (an *APIError such as a 404, or too many reconnects) ends the
// sequence as its last pair; so does the end of ctx.
func (c *Client) Watch(ctx context.Context, tenant, id string, opts WatchOptions) iter.Seq2[Event, error] {
	return c.watch(ctx, tenantPath(tenant, "jobs", id, "events"), opts, func() func(Event) bool {
		var st contracts.JobStatus
		return func(ev Event) bool {
			// The gateway folds the job's events the same way to end the
			// stream; folding here tells an end from a broken connection.
			_ = st.Apply(ev.Event, ev.Seq)
			return st.State.Terminal()
		}
	}, func() bool {
		// A watch resumed with After has not seen the events that the
		// fold needs: the job's status says whether the end was its end.
		st, err := c.Job(ctx, tenant, id)
		return err == nil && st.State.Terminal()
	})
}

// WatchTenant follows every job event of the tenant, history first, until
// ctx ends, reconnecting like Watch.
func (c *Client) WatchTenant(ctx context.Context, tenant string, opts WatchOptions) iter.Seq2[Event, error] {
	return c.watch(ctx, tenantPath(tenant, "events"), opts, func() func(Event) bool {
		return func(Event) bool { return false }
	}, func() bool { return false })
}

// errStreamEnded: the server closed the stream before the end.
var errStreamEnded = errors.New("event stream ended before the job did")

// watch follows the stream at p; newTerminal makes the test of whether an
// event ends it, ended whether a stream the server closed has ended.
func (c *Client) watch(ctx context.Context, p string, opts WatchOptions, newTerminal func() func(Event) bool, ended func() bool) iter.Seq2[Event, error] {
	maxFailures := opts.MaxReconnects
	if maxFailures == 0 {
		maxFailures = DefaultMaxReconnects
	}
	return func(yield func(Event, error) bool) {
		last := opts.After
		failures := 0
		terminal := newTerminal()
		for {
			progressed := false
			done, stopped, err := c.events(ctx, p, last, func(ev Event) (bool, bool) {
				// The server resumes after Last-Event-ID; a sequence at or
				// before the last one is a repeat all the same.
				if ev.Seq <= last {
					return true, false
				}
				last, progressed = ev.Seq, true
				if !yield(ev, nil) {
					return false, false
				}
				return true, terminal(ev)
			})
			if stopped || done {
				return
			}
			if ctx.Err() != nil {
				yield(Event{}, ctx.Err())
				return
			}
			if errors.Is(err, errStreamEnded) && ended() {
				return
			}
			// A refusal (404, 403, a bad Last-Event-ID) is final; a 503
			// (too many streams, the bus away) or a transport error is not.
			if ae, ok := AsAPIError(err); ok && ae.StatusCode != http.StatusServiceUnavailable && ae.StatusCode != http.StatusTooManyRequests && ae.StatusCode < 500 {
				yield(Event{}, err)
				return
			}
			if progressed {
				failures = 0
			}
			if failures++; maxFailures < 0 || failures > maxFailures {
				yield(Event{}, fmt.Errorf("event stream lost %d times in a row: %w", failures, err))
				return
			}
			wait := c.retry.delay(failures)
			if wait < 100*time.Millisecond {
				wait = 100 * time.Millisecond
			}
			if serr := sleepCtx(ctx, wait); serr != nil {
				yield(Event{}, serr)
				return
			}
		}
	}
}

// events reads one server-sent event stream after stream sequence last,
// handing each event to fn, which says whether to go on and whether the
// event ended the stream (done). stopped: fn asked to stop.
func (c *Client) events(ctx context.Context, p string, last uint64, fn func(Event) (more, done bool)) (done, stopped bool, err error) {
	h := http.Header{"Accept": {"text/event-stream"}}
	if last > 0 {
		h.Set("Last-Event-ID", strconv.FormatUint(last, 10))
	}
	// One attempt: the watch loop does its own reconnecting.
	res, err := c.do(ctx, request{method: http.MethodGet, path: p, header: h, stream: true})
	if err != nil {
		return false, false, err
	}
	defer res.Body.Close()
	sc := bufio.NewScanner(res.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	var id string
	var data []string
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			if len(data) > 0 {
				raw := []byte(strings.Join(data, "\n"))
				var ev contracts.JobEvent
				seq, serr := strconv.ParseUint(id, 10, 64)
				if json.Unmarshal(raw, &ev) == nil && serr == nil {
					more, end := fn(Event{Seq: seq, Event: ev, Raw: raw})
					if !more {
						return false, true, nil
					}
					if end {
						return true, false, nil
					}
				}
			}
			id, data = "", nil
			continue
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "id":
			id = value
		case "data":
			data = append(data, value)
		}
	}
	if err := sc.Err(); err != nil {
		return false, false, fmt.Errorf("event stream: %w", err)
	}
	return false, false, errStreamEnded
}
