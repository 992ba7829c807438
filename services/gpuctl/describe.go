package gpuctl

import (
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// describeCmd prints everything the gateway knows about one job, as
// kubectl describe does: what it asked for, why it waits (first, since
// that is what one asks), where it runs, and its events.
func (a *app) describeCmd(*flag.FlagSet) func(context.Context, []string, []string) int {
	return func(ctx context.Context, pos, trailing []string) int {
		id, ok := a.onePositional("describe", pos, trailing)
		if !ok {
			return ExitUsage
		}
		if err := checkNames(a.tenant, id); err != nil {
			return a.usageErr("describe", "%v", err)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("describe", err)
		}
		d, err := c.DescribeJob(ctx, a.tenant, id)
		if err != nil {
			return a.fail("describe", err)
		}
		if a.output == "json" {
			return a.printJSON(d)
		}
		showDescription(a.stdout, d, time.Now())
		return ExitOK
	}
}

// showDescription prints d; now dates the pending reason ("for 5m").
func showDescription(w io.Writer, d contracts.JobDescription, now time.Time) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row := func(k, v string) {
		if v != "" {
			fmt.Fprintf(tw, "%s:\t%s\n", k, v)
		}
	}
	row("Job", d.JobID)
	row("Name", d.Name)
	row("Tenant", d.Tenant)
	row("State", fmt.Sprintf("%s (attempt %d)", d.State, d.Attempt))
	if p := d.Pending; p != nil {
		row("Pending", fmt.Sprintf("%s for %s (since %s)", p.Reason, now.Sub(p.Since).Truncate(time.Second), formatTime(&p.Since)))
		row("Why", p.Message)
	} else if d.Reason != "" {
		row("Reason", string(d.Reason))
		row("Message", d.Message)
	}
	for _, f := range d.Errors {
		row("Error", f.Error())
	}
	if r := d.Request; r != nil {
		row("Priority", string(r.Priority))
		row("Pool", r.Pool)
		row("Requested", requested(r))
		row("Per machine", hostResources(r.Resources))
		row("Node selector", selector(r.NodeSelector))
		row("Tolerations", tolerations(r.Tolerations))
		row("Depends on", strings.Join(d.DependsOn, ", "))
		if r.PlacementTimeout > 0 {
			row("Placement timeout", r.PlacementTimeout.D().String())
		}
		if r.ExpectedRunTime > 0 {
			row("Expected run time", r.ExpectedRunTime.D().String())
		}
		row("Run", runSpec(r.Run))
	}
	if d.ExitCode != nil {
		row("Exit code", strconv.Itoa(*d.ExitCode))
	}
	row("Created", formatTime(&d.CreatedAt))
	row("Updated", formatTime(&d.UpdatedAt))
	row("Started", formatTime(d.StartedAt))
	row("Ended", formatTime(d.EndedAt))
	_ = tw.Flush()

	if len(d.Placements) > 0 {
		fmt.Fprintln(w, "\nPlacements:")
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  RANK\tNODE\tPOOL\tGPUS\tALLOCATION")
		for i, p := range d.Placements {
			fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\t%s\n", i, p.NodeID, dash(p.Pool), dash(devices(&p)), p.AllocationID)
		}
		_ = tw.Flush()
	}
	fmt.Fprintln(w, "\nEvents:")
	if d.EventsOmitted > 0 {
		fmt.Fprintf(w, "  (%d earlier events not shown)\n", d.EventsOmitted)
	}
	if len(d.Events) == 0 {
		fmt.Fprintln(w, "  <none>")
		return
	}
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  TIME\tTYPE\tATTEMPT\tREASON\tMESSAGE")
	for _, e := range d.Events {
		fmt.Fprintf(tw, "  %s\t%s\t%d\t%s\t%s\n", formatTime(&e.Time), e.Type, e.Attempt, dash(string(e.Reason)), e.Message)
	}
	_ = tw.Flush()
}

// hostResources is a request's CPU and host memory per machine: "8 CPU,
// 64 GiB"; "" when it asks for neither.
func hostResources(r contracts.Resources) string {
	var parts []string
	if r.CPUMilli > 0 {
		parts = append(parts, strconv.FormatFloat(float64(r.CPUMilli)/1000, 'f', -1, 64)+" CPU")
	}
	if r.MemoryMiB > 0 {
		parts = append(parts, memory(r.MemoryMiB))
	}
	return strings.Join(parts, ", ")
}

// memory shows MiB in the largest binary unit that divides it.
func memory(mib int64) string {
	switch {
	case mib%(1<<20) == 0:
		return strconv.FormatInt(mib>>20, 10) + " TiB"
	case mib%(1<<10) == 0:
		return strconv.FormatInt(mib>>10, 10) + " GiB"
	}
	return strconv.FormatInt(mib, 10) + " MiB"
}

// selector is "purpose=training,zone=a".
func selector(sel map[string]string) string {
	parts := make([]string, 0, len(sel))
	for _, k := range slices.Sorted(maps.Keys(sel)) {
		parts = append(parts, k+"="+sel[k])
	}
	return strings.Join(parts, ",")
}

// tolerations is "spot=true:NoSchedule, gpu-test:Exists", as --toleration
// takes them.
func tolerations(ts []contracts.Toleration) string {
	parts := make([]string, 0, len(ts))
	for _, t := range ts {
		s := t.Key + ":" + string(contracts.TolerationExists)
		if t.Operator != contracts.TolerationExists {
			s = t.Key + "=" + t.Value
		}
		if t.Effect != "" {
			s += ":" + string(t.Effect)
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, ", ")
}

// taints is "spot=true:NoSchedule, gpu-test:NoSchedule".
func taints(ts []contracts.Taint) string {
	parts := make([]string, 0, len(ts))
	for _, t := range ts {
		s := t.Key
		if t.Value != "" {
			s += "=" + t.Value
		}
		parts = append(parts, s+":"+string(t.Effect))
	}
	return strings.Join(parts, ", ")
}
