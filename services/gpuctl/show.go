package gpuctl

import (
	"context"
	"encoding/csv"
	"flag"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// timeLayout is how tables show times (local time zone).
const timeLayout = "2006-01-02 15:04:05"

func (a *app) getCmd(*flag.FlagSet) func(context.Context, []string, []string) int {
	return func(ctx context.Context, pos, trailing []string) int {
		id, ok := a.onePositional("get", pos, trailing)
		if !ok {
			return ExitUsage
		}
		if err := checkNames(a.tenant, id); err != nil {
			return a.usageErr("get", "%v", err)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("get", err)
		}
		st, err := c.Job(ctx, a.tenant, id)
		if err != nil {
			return a.fail("get", err)
		}
		if a.output == "json" {
			return a.printJSON(st)
		}
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		row := func(k, v string) {
			if v != "" {
				fmt.Fprintf(tw, "%s:\t%s\n", k, v)
			}
		}
		row("ID", st.JobID)
		row("Tenant", st.Tenant)
		row("Name", st.Name)
		row("State", string(st.State))
		row("Attempt", strconv.Itoa(st.Attempt))
		row("Reason", string(st.Reason))
		row("Message", st.Message)
		if r := st.Request; r != nil {
			row("Priority", string(r.Priority))
			row("Pool", r.Pool)
			row("Requested", requested(r))
			row("Run", runSpec(r.Run))
		}
		if p := st.Placement; p != nil {
			row("Node", p.NodeID+" (pool "+p.Pool+")")
			row("GPUs", devices(p))
		}
		if st.ExitCode != nil {
			row("Exit code", strconv.Itoa(*st.ExitCode))
		}
		if m := st.Migration; m != nil {
			row("Migration", migration(m, st.Migrations))
		}
		row("Created", formatTime(&st.CreatedAt))
		row("Updated", formatTime(&st.UpdatedAt))
		row("Started", formatTime(st.StartedAt))
		row("Ended", formatTime(st.EndedAt))
		for _, f := range st.Errors {
			row("Error", f.Error())
		}
		_ = tw.Flush()
		return ExitOK
	}
}

func (a *app) listCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var state string
	var limit int
	fs.StringVar(&state, "state", "", "only jobs in this state: queued, scheduled, running, succeeded, failed, cancelled or rejected")
	fs.IntVar(&limit, "limit", 0, "at most this many jobs, newest first (gateway default 100, at most 1000)")
	var after string
	fs.StringVar(&after, "after", "", "the page after this job (the next page: the last ID listed)")
	return func(ctx context.Context, pos, trailing []string) int {
		if !a.noPositional("list", pos, trailing) {
			return ExitUsage
		}
		if err := contracts.ValidateTenant(a.tenant); err != nil {
			return a.usageErr("list", "%v", err)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("list", err)
		}
		page, err := c.ListJobs(ctx, a.tenant, gpuplane.ListOptions{State: contracts.JobState(state), Limit: limit, After: after})
		if err != nil {
			return a.fail("list", err)
		}
		list := contracts.JobList{Jobs: page.Jobs}
		if a.output == "json" {
			return a.printJSON(list)
		}
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tNAME\tSTATE\tATTEMPT\tREASON\tNODE\tGPUS\tCREATED")
		for _, j := range list.Jobs {
			node, gpus := "", ""
			if j.Placement != nil {
				node, gpus = j.Placement.NodeID, devices(j.Placement)
			} else if j.Request != nil {
				gpus = requested(j.Request)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", j.JobID, dash(j.Name), j.State, j.Attempt,
				dash(string(j.Reason)), dash(node), dash(gpus), formatTime(&j.CreatedAt))
		}
		_ = tw.Flush()
		if len(list.Jobs) == 0 {
			fmt.Fprintf(a.stdout, "no jobs for tenant %s\n", a.tenant)
		}
		if page.Next != "" {
			fmt.Fprintf(a.stdout, "more jobs may follow: --after %s\n", page.Next)
		}
		return ExitOK
	}
}

func (a *app) usageCmd(*flag.FlagSet) func(context.Context, []string, []string) int {
	return func(ctx context.Context, pos, trailing []string) int {
		if !a.noPositional("usage", pos, trailing) {
			return ExitUsage
		}
		if err := contracts.ValidateTenant(a.tenant); err != nil {
			return a.usageErr("usage", "%v", err)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("usage", err)
		}
		sum, err := c.Usage(ctx, a.tenant)
		if err != nil {
			return a.fail("usage", err)
		}
		switch a.output {
		case "json":
			return a.printJSON(sum)
		case "csv":
			return a.usageCSV(sum)
		}
		fmt.Fprintf(a.stdout, "tenant %s: %.0f GPU-seconds in %d records, cost %s %s (at on-demand rates %s)\n", sum.Tenant,
			sum.GPUSeconds, sum.Records, contracts.Money(sum.CostMicros).CentString(), sum.Currency,
			contracts.Money(sum.OnDemandCostMicros).CentString())
		if len(sum.ByJob) == 0 {
			return ExitOK
		}
		type agg struct {
			n               int
			gpuMillis, cost int64
		}
		byDay, byPool := map[string]*agg{}, map[string]*agg{}
		add := func(m map[string]*agg, k string, r contracts.UsageRecord) {
			if m[k] == nil {
				m[k] = &agg{}
			}
			m[k].n++
			m[k].gpuMillis += r.GPUMillis
			m[k].cost += r.CostMicros
		}
		for _, r := range sum.ByJob {
			add(byDay, r.Start.UTC().Format(time.DateOnly), r)
			add(byPool, r.Pool+" ("+string(r.PriceClass)+")", r)
		}
		for _, t := range []struct {
			title string
			m     map[string]*agg
		}{{"DAY (UTC)", byDay}, {"POOL (CLASS)", byPool}} {
			fmt.Fprintln(a.stdout)
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintf(tw, "%s\tRECORDS\tGPU-HOURS\tCOST\n", t.title)
			for _, k := range slices.Sorted(maps.Keys(t.m)) {
				v := t.m[k]
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", k, v.n, gpuHours(v.gpuMillis), contracts.Money(v.cost).CentString())
			}
			_ = tw.Flush()
		}
		fmt.Fprintln(a.stdout)
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "JOB\tATTEMPT\tSEG\tNODE\tGPUS\tMODEL\tCLASS\tSTART\tEND\tGPU-SECONDS\tCOST")
		for _, r := range sum.ByJob {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t%s\n", r.JobID, r.Attempt, r.Segment, dash(r.NodeID),
				share(r), dash(r.GPUModel), dash(string(r.PriceClass)), formatTime(&r.Start), formatTime(&r.End), r.GPUSeconds,
				contracts.Money(r.CostMicros).CentString())
		}
		_ = tw.Flush()
		return ExitOK
	}
}

// share is a record's GPUs: "2", or "1 (3/7)" for a MIG instance.
func share(r contracts.UsageRecord) string {
	s := strconv.Itoa(r.GPUs)
	if r.GPUShare != "" && r.GPUShare != s {
		s += " (" + r.GPUShare + ")"
	}
	return s
}

// usageCSV writes one row per usage record; amounts are exact decimals.
func (a *app) usageCSV(sum contracts.UsageSummary) int {
	w := csv.NewWriter(a.stdout)
	_ = w.Write([]string{"tenant", "job", "attempt", "segment", "allocation", "node", "pool", "price_class", "gpu_model", "gpus",
		"gpu_share", "start", "end", "seconds", "gpu_seconds", "price_version", "currency", "cost", "on_demand_cost", "reason"})
	for _, r := range sum.ByJob {
		_ = w.Write([]string{r.Tenant, r.JobID, strconv.Itoa(r.Attempt), strconv.Itoa(r.Segment), r.AllocationID, r.NodeID, r.Pool,
			string(r.PriceClass), r.GPUModel, strconv.Itoa(r.GPUs), r.GPUShare, r.Start.UTC().Format(time.RFC3339Nano),
			r.End.UTC().Format(time.RFC3339Nano), strconv.FormatInt(r.Seconds, 10), strconv.FormatFloat(r.GPUSeconds, 'f', -1, 64),
			r.PriceVersion, r.Currency, contracts.Money(r.CostMicros).String(), contracts.Money(r.OnDemandCostMicros).String(), string(r.Reason)})
	}
	w.Flush()
	if err := w.Error(); err != nil {
		return a.fail("usage", err)
	}
	return ExitOK
}

// requested is what a request asks for: "2 × H100-80GB (≥ 40000 MiB)",
// "16 × H100-80GB over 2 machines (8 each), NVLink", "MIG 1g.10gb on
// H100-80GB", "share of 1 × L4: 4096 MiB, 25% compute".
func requested(r *contracts.JobRequest) string {
	g := r.Resources.GPU
	model := g.Model
	if model == "" {
		model = contracts.GPUModelAny
	}
	if len(g.Models) > 0 {
		model = strings.Join(g.Models, "|")
	}
	var s string
	switch g.Kind() {
	case contracts.GPUKindMIG:
		s = "MIG " + g.MIGProfile + " on " + model
	case contracts.GPUKindShare:
		s = fmt.Sprintf("share of 1 × %s: %d MiB, %d%% compute", model, g.Share.MemoryMiB, g.Share.ComputePercent)
	default:
		s = fmt.Sprintf("%d × %s", g.Count, model)
	}
	if g.MemoryMiB > 0 {
		s += fmt.Sprintf(" (≥ %d MiB)", g.MemoryMiB)
	}
	if m := g.Machines(); m > 1 {
		s += fmt.Sprintf(" over %d machines (%d each)", m, g.Count/m)
	}
	switch g.Topology {
	case contracts.TopologyNVLink:
		s += ", NVLink"
	case contracts.TopologyZone:
		s += ", one zone"
	}
	return s
}

func runSpec(r contracts.RunSpec) string {
	if len(r.Command) > 0 {
		s := strings.Join(r.Command, " ")
		if r.Duration > 0 {
			s += " (limit " + r.Duration.D().String() + ")"
		}
		return s
	}
	s := "simulated, " + r.Duration.D().String()
	if r.ExitCode != 0 {
		s += fmt.Sprintf(", exit %d", r.ExitCode)
	}
	return s
}

// devices is a placement's GPUs: "2 × H100-80GB [0,1]", "MIG 3g.40gb
// of H100-80GB [7]", "share of L4 [2]".
func devices(p *contracts.Placement) string {
	if len(p.Devices) == 0 {
		return ""
	}
	idx := make([]string, len(p.Devices))
	for i, d := range p.Devices {
		idx[i] = strconv.Itoa(d.Index)
	}
	d := p.Devices[0]
	switch {
	case d.MIG != nil:
		return fmt.Sprintf("MIG %s of %s [%s]", d.MIG.Profile, d.Model, strings.Join(idx, ","))
	case d.Share != nil:
		return fmt.Sprintf("share of %s [%s]", d.Model, strings.Join(idx, ","))
	}
	return fmt.Sprintf("%d × %s [%s]", len(p.Devices), d.Model, strings.Join(idx, ","))
}

func formatTime(t *time.Time) string {
	if t == nil || t.IsZero() {
		return ""
	}
	return t.Local().Format(timeLayout)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// migration says how the job last moved: "1 done; last: spot_interruption
// from attempt 1 on n7, restored ckpt-3".
func migration(m *contracts.Migration, done int) string {
	var from []string
	for _, p := range m.From {
		from = append(from, p.NodeID)
	}
	out := fmt.Sprintf("%d done; last: %s from attempt %d", done, m.Reason, m.FromAttempt)
	if len(from) > 0 {
		out += " on " + strings.Join(from, ", ")
	}
	switch {
	case m.RestoredFrom != "":
		out += ", restored " + m.RestoredFrom
	case m.Deadline != nil:
		out += ", under way (machine goes at " + formatTime(m.Deadline) + ")"
	}
	return out
}
