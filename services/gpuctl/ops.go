package gpuctl

import (
	"context"
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func (a *app) faultCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var kind, gpu, duration string
	var code int
	names := make([]string, len(contracts.FaultKinds))
	for i, k := range contracts.FaultKinds {
		names[i] = string(k)
	}
	fs.StringVar(&kind, "kind", "", "fault kind: "+strings.Join(names, ", "))
	fs.StringVar(&gpu, "gpu", "", "GPU index or UUID (per-GPU faults: default the first GPU; clear: default every fault of the machine)")
	fs.IntVar(&code, "code", 0, "XID code, with --kind xid (default 79: fell off the bus)")
	fs.StringVar(&duration, "duration", "", "how long overheat or agent_pause lasts, e.g. 30s (overheat: until cleared; agent_pause: 30s)")
	return func(ctx context.Context, pos, trailing []string) int {
		if len(pos) != 2 || pos[0] != "inject" || len(trailing) > 0 {
			return a.usageErr("fault", "want: fault inject NODE --kind KIND [--gpu G] [--code N] [--duration D]")
		}
		node := pos[1]
		if err := contracts.ValidateID(node); err != nil {
			return a.usageErr("fault", "node: %v", err)
		}
		if kind == "" {
			return a.usageErr("fault", "--kind is required: one of %s", strings.Join(names, ", "))
		}
		if !slices.Contains(contracts.FaultKinds, contracts.FaultKind(kind)) {
			return a.usageErr("fault", "--kind %q: want one of %s", kind, strings.Join(names, ", "))
		}
		req := contracts.FaultRequest{Kind: contracts.FaultKind(kind), GPU: gpu, Code: code}
		if duration != "" {
			d, err := time.ParseDuration(duration)
			if err != nil {
				return a.usageErr("fault", "--duration %q: want a duration such as 30s", duration)
			}
			req.Duration = contracts.Duration(d)
		}
		// The rest (a GPU the node has, code only with xid) is the
		// gateway's to check: it knows the node.
		c, err := a.api()
		if err != nil {
			return a.fail("fault", err)
		}
		res, err := c.InjectFault(ctx, node, req)
		if err != nil {
			return a.fail("fault", err)
		}
		if a.output == "json" {
			return a.printJSON(res)
		}
		fmt.Fprintf(a.stdout, "fault %s (%s) sent to node %s\n", res.Fault.ID, describeFault(res.Fault), res.NodeID)
		return ExitOK
	}
}

// describeFault is "xid 79 on GPU 3", "agent_pause for 30s", "clear on the whole machine".
func describeFault(f contracts.Fault) string {
	s := string(f.Kind)
	if f.Kind == contracts.FaultXID {
		s += fmt.Sprintf(" %d", f.XIDCode())
	}
	switch {
	case f.GPU != "":
		s += " on GPU " + f.GPU
	case f.Kind == contracts.FaultClear, f.Kind == contracts.FaultMachineDeath, f.Kind == contracts.FaultAgentPause:
		s += " on the whole machine"
	default:
		s += " on the first GPU"
	}
	if f.Duration > 0 {
		s += " for " + f.Duration.D().String()
	}
	return s
}

func (a *app) checkpointCmd(*flag.FlagSet) func(context.Context, []string, []string) int {
	return func(ctx context.Context, pos, trailing []string) int {
		id, ok := a.onePositional("checkpoint", pos, trailing)
		if !ok {
			return ExitUsage
		}
		if err := checkNames(a.tenant, id); err != nil {
			return a.usageErr("checkpoint", "%v", err)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("checkpoint", err)
		}
		res, err := c.CheckpointJob(ctx, a.tenant, id)
		if err != nil {
			return a.fail("checkpoint", err)
		}
		if a.output == "json" {
			return a.printJSON(res)
		}
		fmt.Fprintf(a.stdout, "checkpoint requested for job %s (attempt %d on node %s)\n", res.JobID, res.Attempt, res.NodeID)
		return ExitOK
	}
}
