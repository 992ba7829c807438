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

	"github.com/gpuplane/gpuplane/contracts"
)

func (a *app) nodesCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var pool string
	fs.StringVar(&pool, "pool", "", "only nodes of this pool")
	return func(ctx context.Context, pos, trailing []string) int {
		c, err := a.api()
		if err != nil {
			return a.fail("nodes", err)
		}
		switch {
		case len(pos) == 1 && len(trailing) == 0:
			if err := contracts.ValidateID(pos[0]); err != nil {
				return a.usageErr("nodes", "%v", err)
			}
			st, err := c.Node(ctx, pos[0])
			if err != nil {
				return a.fail("nodes", err)
			}
			if a.output == "json" {
				return a.printJSON(st)
			}
			showNode(a.stdout, st)
			return ExitOK
		case len(pos)+len(trailing) > 1:
			return a.usageErr("nodes", "want at most one node ID, got %d arguments", len(pos)+len(trailing))
		}
		list, err := c.Nodes(ctx, pool)
		if err != nil {
			return a.fail("nodes", err)
		}
		if a.output == "json" {
			return a.printJSON(list)
		}
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NODE\tPOOL\tMACHINE\tBACKEND\tSTATE\tSCHEDULING\tGPUS\tHEALTHY\tMIG\tDRIVER\tCUDA\tTOPOLOGY\tZONE\tTAINTS")
		for _, n := range list.Nodes {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", n.NodeID, dash(n.Pool), dash(n.MachineType), dash(n.Backend),
				dash(string(n.Lifecycle)), scheduling(n.Admin), dash(gpuSummary(n.GPUs)), healthSummary(n.GPUs), dash(migSummary(n.GPUs)),
				dash(n.DriverVersion), dash(n.CUDAVersion), topologySummary(len(n.GPUs), n.Topology), dash(n.Zone), dash(taints(n.Taints)))
		}
		_ = tw.Flush()
		if len(list.Nodes) == 0 {
			fmt.Fprintln(a.stdout, "no nodes")
		}
		return ExitOK
	}
}

// showNode prints one node: its facts, its GPUs, their MIG instances and
// the topology matrix as nvidia-smi topo -m shows it.
func showNode(w io.Writer, n contracts.NodeStatus) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row := func(k, v string) {
		if v != "" {
			fmt.Fprintf(tw, "%s:\t%s\n", k, v)
		}
	}
	row("Node", n.NodeID)
	row("Hostname", n.Hostname)
	row("Pool", n.Pool)
	row("Zone", n.Zone)
	row("Machine type", n.MachineType)
	row("Price class", n.PriceClass)
	if len(n.Labels) > 0 {
		labels := make([]string, 0, len(n.Labels))
		for _, k := range slices.Sorted(maps.Keys(n.Labels)) {
			labels = append(labels, k+"="+n.Labels[k])
		}
		row("Labels", strings.Join(labels, ","))
	}
	row("Purpose", n.Purpose)
	row("Taints", taints(n.Taints))
	row("Backend", n.Backend)
	if n.Lifecycle != "" {
		row("State", string(n.Lifecycle)+" since "+formatTime(&n.LifecycleAt))
	}
	if a := n.Admin; a != nil {
		row("Scheduling", scheduling(a)+" since "+formatTime(&a.Time)+because(a.Reason))
		if a.Deadline != nil {
			// A spot reclaim: the machine is gone at this time.
			row("Deadline", formatTime(a.Deadline))
		}
	}
	row("Driver", n.DriverVersion)
	row("CUDA", n.CUDAVersion)
	if n.CPUMilli > 0 {
		row("CPU", strconv.FormatFloat(float64(n.CPUMilli)/1000, 'f', -1, 64)+" cores")
	}
	if n.MemoryMiB > 0 {
		row("Memory", fmt.Sprintf("%d GiB", n.MemoryMiB/1024))
	}
	row("GPUs", gpuSummary(n.GPUs)+", "+healthSummary(n.GPUs)+" healthy")
	row("Topology", topologySummary(len(n.GPUs), n.Topology))
	row("Incarnation", n.Incarnation)
	row("Inventory at", formatTime(&n.Time))
	_ = tw.Flush()

	if len(n.GPUs) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "GPU\tUUID\tMODEL\tMEMORY\tCC\tPCI\tHEALTH\tMIG")
		for _, g := range n.GPUs {
			health := "ok"
			if !g.Healthy {
				health = "UNHEALTHY"
			}
			mig := "off"
			if g.MIGEnabled {
				mig = fmt.Sprintf("on, %d instances", len(g.MIGInstances))
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%d MiB\t%s\t%s\t%s\t%s\n", g.Index, g.UUID, g.Model, g.MemoryMiB,
				dash(g.ComputeCapability), dash(g.PCIBusID), health, mig)
		}
		_ = tw.Flush()
	}
	gpuHolds(w, n)
	if slices.ContainsFunc(n.GPUs, func(g contracts.GPUInfo) bool { return len(g.MIGInstances) > 0 }) {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "GPU\tMIG PROFILE\tUUID\tGI\tCI\tPLACEMENT\tMEMORY")
		for _, g := range n.GPUs {
			for _, m := range g.MIGInstances {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%d\t%d:%d\t%d MiB\n", g.Index, m.Profile, m.UUID, m.GIID, m.CIID, m.Start, m.Size, m.MemoryMiB)
			}
		}
		_ = tw.Flush()
	}
	if len(n.Topology) > 0 && len(n.GPUs) > 1 {
		fmt.Fprintln(w)
		topologyMatrix(w, n.GPUs, n.Topology)
	}
}

// topologyMatrix prints the link between every two GPUs: NV<n> for n
// NVLink links, the PCIe path otherwise, X on the diagonal.
func topologyMatrix(w io.Writer, gpus []contracts.GPUInfo, links []contracts.GPULink) {
	cell := map[[2]int]string{}
	for _, l := range links {
		v := string(l.Path)
		if l.NVLinks > 0 {
			v = "NV" + strconv.Itoa(l.NVLinks)
		}
		cell[[2]int{l.A, l.B}], cell[[2]int{l.B, l.A}] = v, v
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	head := []string{""}
	for _, g := range gpus {
		head = append(head, "GPU"+strconv.Itoa(g.Index))
	}
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	for _, a := range gpus {
		row := []string{"GPU" + strconv.Itoa(a.Index)}
		for _, b := range gpus {
			v := "X"
			if a.Index != b.Index {
				v = dash(cell[[2]int{a.Index, b.Index}])
			}
			row = append(row, v)
		}
		fmt.Fprintln(tw, strings.Join(row, "\t"))
	}
	_ = tw.Flush()
}

// scheduling is a node's hold: "schedulable", "cordoned" or "draining",
// with the platform's cause ("draining (spot_interruption)") and the
// count of GPUs held on their own ("schedulable, 1 GPU held").
func scheduling(a *contracts.NodeAdmin) string {
	var s string
	switch {
	case a == nil || !a.Cordoned && !a.Drain:
		s = "schedulable"
	case a.Drain:
		s = "draining"
	default:
		s = "cordoned"
	}
	if a == nil {
		return s
	}
	if a.Cause != "" && (a.Cordoned || a.Drain) {
		s += " (" + string(a.Cause) + ")"
	}
	switch n := heldGPUs(a); n {
	case 0:
	case 1:
		s += ", 1 GPU held"
	default:
		s += fmt.Sprintf(", %d GPUs held", n)
	}
	return s
}

// heldGPUs counts the GPUs a keeps off new work on their own.
func heldGPUs(a *contracts.NodeAdmin) int {
	n := 0
	for _, h := range a.GPUs {
		if h.Cordoned || h.Drain {
			n++
		}
	}
	return n
}

// gpuHolds prints the GPUs held on their own: what the hold does, why
// (the platform's cause, or an administrator's) and since when.
func gpuHolds(w io.Writer, n contracts.NodeStatus) {
	a := n.Admin
	if a == nil || heldGPUs(a) == 0 {
		return
	}
	index := map[string]string{}
	for _, g := range n.GPUs {
		index[g.UUID] = strconv.Itoa(g.Index)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "HELD GPU\tUUID\tHOLD\tCAUSE\tREASON\tSINCE")
	for _, uuid := range slices.Sorted(maps.Keys(a.GPUs)) {
		h := a.GPUs[uuid]
		if !h.Cordoned && !h.Drain {
			continue
		}
		hold, cause := "cordoned", string(h.Cause)
		if h.Drain {
			hold = "draining"
		}
		if cause == "" {
			cause = "administrator"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", dash(index[uuid]), uuid, hold, cause, dash(h.Reason), dash(formatTime(&h.Since)))
	}
	_ = tw.Flush()
}

// gpuSummary is "8 × H100-80GB", or "4 × A100-80GB, 4 × L4" for a mix.
func gpuSummary(gpus []contracts.GPUInfo) string {
	var models []string
	count := map[string]int{}
	for _, g := range gpus {
		if count[g.Model] == 0 {
			models = append(models, g.Model)
		}
		count[g.Model]++
	}
	parts := make([]string, len(models))
	for i, m := range models {
		parts[i] = fmt.Sprintf("%d × %s", count[m], m)
	}
	return strings.Join(parts, ", ")
}

// healthSummary is "7/8": healthy GPUs of all.
func healthSummary(gpus []contracts.GPUInfo) string {
	ok := 0
	for _, g := range gpus {
		if g.Healthy {
			ok++
		}
	}
	return fmt.Sprintf("%d/%d", ok, len(gpus))
}

// migSummary is "9 instances on 2 GPUs" when MIG is on anywhere, "" otherwise.
func migSummary(gpus []contracts.GPUInfo) string {
	on, instances := 0, 0
	for _, g := range gpus {
		if g.MIGEnabled {
			on++
			instances += len(g.MIGInstances)
		}
	}
	if on == 0 {
		return ""
	}
	unit := "GPUs"
	if on == 1 {
		unit = "GPU"
	}
	return fmt.Sprintf("%d instances on %d %s", instances, on, unit)
}

// closePaths are PCIe paths that do not cross a host bridge: GPUs that
// share a board or a PCIe switch.
var closePaths = []contracts.TopoPath{contracts.TopoInternal, contracts.TopoSingle, contracts.TopoMultiple}

// topologySummary says in a few words how a machine's n GPUs are linked:
// "NVLink all-to-all, 18 links", "NVLink pairs, 4 links", "PCIe pairs",
// "PCIe only (SYS)".
func topologySummary(n int, links []contracts.GPULink) string {
	switch {
	case n == 1:
		return "single GPU"
	case n == 0 || len(links) == 0:
		return "-"
	}
	var nv []contracts.GPULink
	var near []contracts.GPULink
	paths := map[contracts.TopoPath]bool{}
	lo, hi := 0, 0
	for _, l := range links {
		if l.NVLinks > 0 {
			if len(nv) == 0 {
				lo, hi = l.NVLinks, l.NVLinks
			}
			lo, hi = min(lo, l.NVLinks), max(hi, l.NVLinks)
			nv = append(nv, l)
		}
		if slices.Contains(closePaths, l.Path) {
			near = append(near, l)
		}
		paths[l.Path] = true
	}
	count := strconv.Itoa(lo)
	if hi != lo {
		count += "-" + strconv.Itoa(hi)
	}
	switch {
	case len(nv) == n*(n-1)/2:
		return "NVLink all-to-all, " + count + " links"
	case len(nv) > 0 && pairsUp(n, nv):
		return "NVLink pairs, " + count + " links"
	case len(nv) > 0:
		return fmt.Sprintf("NVLink partial (%d of %d GPU pairs), %s links", len(nv), n*(n-1)/2, count)
	case len(near) > 0 && pairsUp(n, near):
		return "PCIe pairs"
	case len(paths) == 1:
		for p := range paths {
			return "PCIe only (" + string(p) + ")"
		}
	}
	return "PCIe mixed"
}

// pairsUp reports whether links join the n GPUs two by two: each GPU in
// exactly one link.
func pairsUp(n int, links []contracts.GPULink) bool {
	if len(links)*2 != n {
		return false
	}
	seen := map[int]bool{}
	for _, l := range links {
		if seen[l.A] || seen[l.B] {
			return false
		}
		seen[l.A], seen[l.B] = true, true
	}
	return true
}
