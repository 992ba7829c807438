package gpuctl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

func (a *app) watchCmd(*flag.FlagSet) func(context.Context, []string, []string) int {
	return func(ctx context.Context, pos, trailing []string) int {
		id, ok := a.onePositional("watch", pos, trailing)
		if !ok {
			return ExitUsage
		}
		if err := checkNames(a.tenant, id); err != nil {
			return a.usageErr("watch", "%v", err)
		}
		return a.watch(ctx, id)
	}
}

// watch prints the job's events, its history first, until it reaches a
// terminal state: ExitOK when it succeeded, ExitError otherwise.
func (a *app) watch(ctx context.Context, id string) int {
	w := &watcher{app: a}
	var err error
	if a.via == viaBus {
		err = a.watchBus(ctx, id, w)
	} else {
		err = a.watchGateway(ctx, id, w)
	}
	if err != nil {
		return a.fail("watch", err)
	}
	if w.st.State != contracts.StateSucceeded {
		return ExitError
	}
	return ExitOK
}

// watcher folds the events it is shown and prints those the state machine
// accepts: a repeated event (after a reconnect) or a refused one (a
// rejected duplicate submit of an accepted job) is not the job's story.
type watcher struct {
	*app
	st contracts.JobStatus
}

// see handles one event at stream sequence seq and reports whether the
// job is now terminal.
func (w *watcher) see(ev contracts.JobEvent, seq uint64, raw []byte) bool {
	if err := w.st.Apply(ev, seq); err != nil {
		return w.st.State.Terminal()
	}
	if w.output == "json" {
		var buf bytes.Buffer
		if json.Compact(&buf, raw) == nil {
			fmt.Fprintln(w.stdout, buf.String())
		}
	} else {
		fmt.Fprintln(w.stdout, eventLine(ev))
	}
	return w.st.State.Terminal()
}

// eventLine is one event for people:
// "12:00:01.234 scheduled attempt=1 node=node-1 gpus=0,1".
func eventLine(ev contracts.JobEvent) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s attempt=%d", ev.Time.Local().Format("15:04:05.000"), ev.Type, ev.Attempt)
	if ev.Reason != "" {
		fmt.Fprintf(&b, " reason=%s", ev.Reason)
	}
	if p := ev.Placement; p != nil {
		idx := make([]string, len(p.Devices))
		for i, d := range p.Devices {
			idx[i] = strconv.Itoa(d.Index)
		}
		fmt.Fprintf(&b, " node=%s gpus=%s", p.NodeID, strings.Join(idx, ","))
	}
	if ev.ExitCode != nil {
		fmt.Fprintf(&b, " exit=%d", *ev.ExitCode)
	}
	if ev.Message != "" {
		fmt.Fprintf(&b, " message=%q", ev.Message)
	}
	for _, f := range ev.Errors {
		fmt.Fprintf(&b, " error=%q", f.Error())
	}
	return b.String()
}

// watchGateway follows the gateway's per-job event stream; the client
// reconnects with Last-Event-ID when it breaks before the job ends.
func (a *app) watchGateway(ctx context.Context, id string, w *watcher) error {
	c, err := a.api()
	if err != nil {
		return err
	}
	for ev, err := range c.Watch(ctx, a.tenant, id, gpuplane.WatchOptions{}) {
		if err != nil {
			return err
		}
		if w.see(ev.Event, ev.Seq, ev.Raw) {
			return nil
		}
	}
	return nil
}

// watchBus reads the job's subject of JOB_EVENTS from its first message
// with an ordered consumer, like any other reader of the stream.
func (a *app) watchBus(ctx context.Context, id string, w *watcher) error {
	b, err := a.connectBus(ctx)
	if err != nil {
		return err
	}
	defer closeBus(b)
	errDone := errors.New("job ended")
	spec := bus.FollowSpec{Stream: contracts.StreamJobEvents, FilterSubjects: []string{contracts.SubjectJobEvents(a.tenant, id)}}
	err = b.Follow(ctx, spec, func(_ context.Context, m *bus.Msg) error {
		var ev contracts.JobEvent
		if err := m.Decode(&ev); err != nil {
			fmt.Fprintf(a.stderr, "gpuctl watch: skipping event %d: %v\n", m.StreamSeq, err)
			return nil
		}
		if w.see(ev, m.StreamSeq, m.Data) {
			return errDone
		}
		return nil
	}, nil)
	switch {
	case errors.Is(err, errDone):
		return nil
	case err == nil: // Follow returns nil when ctx ends
		return ctx.Err()
	}
	return err
}
