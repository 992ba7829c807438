package gpuctl

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// The scheduling administration commands: quota, pool, cordon, drain and
// uncordon. Edits go through the gateway, which keeps them in KV; the
// scheduler applies them at its next cycle.

// quotaCmd is "quota get", "quota list", "quota set" and "quota delete"
// for --tenant. set edits the stored quota: it reads it, changes what the
// flags name, and writes it back only if nobody changed it meanwhile.
func (a *app) quotaCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var file, pool, maxGPUs string
	var guarantee, weight float64
	var strictFIFO bool
	fs.StringVar(&file, "f", "", "set: replace the whole quota with this YAML or JSON file (- for stdin)")
	fs.StringVar(&pool, "pool", contracts.QuotaAllPools, `set: the pool --guarantee and --max apply to ("*": every pool without its own entry)`)
	fs.Float64Var(&guarantee, "guarantee", 0, "set: GPUs the tenant always gets in --pool, reclaimed by preemption from borrowers")
	fs.StringVar(&maxGPUs, "max", "", `set: most GPUs the tenant may hold in --pool, borrowing included ("none": no bound)`)
	fs.Float64Var(&weight, "weight", 0, "set: fair-share weight (0: default 1)")
	fs.BoolVar(&strictFIFO, "strict-fifo", false, "set: a job that cannot be placed holds back the tenant's later jobs of its class")
	return func(ctx context.Context, pos, trailing []string) int {
		if len(pos) != 1 || len(trailing) > 0 || !slices.Contains([]string{"get", "list", "set", "delete"}, pos[0]) {
			return a.usageErr("quota", `want "quota get", "quota list", "quota set [--pool P] [--guarantee G] [--max M] [--weight W] [--strict-fifo]" or "quota delete"`)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("quota "+pos[0], err)
		}
		if pos[0] == "list" {
			list, err := c.Quotas(ctx)
			if err != nil {
				return a.fail("quota list", err)
			}
			return a.show(list, func() { a.printQuotas(list.Quotas) })
		}
		if err := contracts.ValidateTenant(a.tenant); err != nil {
			return a.usageErr("quota", "%v", err)
		}
		var doc contracts.QuotaDoc
		switch pos[0] {
		case "get":
			doc, err = c.Quota(ctx, a.tenant)
		case "delete":
			doc, err = c.DeleteQuota(ctx, a.tenant)
		case "set":
			set := map[string]bool{}
			fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
			edits := []string{"pool", "guarantee", "max", "weight", "strict-fifo"}
			var data []byte
			var rev *uint64
			switch {
			case file != "":
				if slices.ContainsFunc(edits, func(e string) bool { return set[e] }) {
					return a.usageErr("quota set", "-f replaces the whole quota: put --pool, --guarantee, --max, --weight and --strict-fifo in the file")
				}
				if data, err = readRequestFile(file); err != nil {
					return a.fail("quota set", err)
				}
			case !slices.ContainsFunc(edits, func(e string) bool { return set[e] }):
				return a.usageErr("quota set", "nothing to set: give --guarantee, --max, --weight, --strict-fifo or -f FILE")
			case set["pool"] && !set["guarantee"] && !set["max"]:
				return a.usageErr("quota set", "--pool names where --guarantee or --max apply: give one of them")
			default:
				cur, err := c.Quota(ctx, a.tenant)
				if err != nil {
					return a.fail("quota set", err)
				}
				q := contracts.TenantQuota{}
				if cur.Quota != nil {
					q = *cur.Quota
				}
				if set["weight"] {
					q.Weight = weight
				}
				if set["strict-fifo"] {
					q.StrictFIFO = strictFIFO
				}
				if set["guarantee"] || set["max"] {
					pq := q.Pools[pool]
					if set["guarantee"] {
						pq.Guarantee = guarantee
					}
					if set["max"] {
						if maxGPUs == "none" {
							pq.Max = nil
						} else {
							m, err := strconv.ParseFloat(maxGPUs, 64)
							if err != nil {
								return a.usageErr("quota set", `--max %q: want a number of GPUs or "none"`, maxGPUs)
							}
							pq.Max = &m
						}
					}
					q.Pools = maps.Clone(q.Pools)
					if q.Pools == nil {
						q.Pools = map[string]contracts.PoolQuota{}
					}
					q.Pools[pool] = pq
				}
				data, _ = json.Marshal(q)
				rev = gpuplane.Revision(cur.Revision)
			}
			q, verr := contracts.DecodeTenantQuota(data, a.tenant)
			if verr != nil {
				return a.fail("quota set", checkedError(verr, "invalid quota"))
			}
			doc, err = c.SetQuota(ctx, a.tenant, q, rev)
		}
		if err != nil {
			return a.fail("quota "+pos[0], err)
		}
		return a.show(doc, func() { a.printQuotas([]contracts.QuotaDoc{doc}) })
	}
}

// show prints v as JSON with -o json, else as table writes it.
func (a *app) show(v any, table func()) int {
	if a.output == "json" {
		return a.printJSON(v)
	}
	table()
	return ExitOK
}

// printQuotas prints one row per tenant and pool.
func (a *app) printQuotas(docs []contracts.QuotaDoc) {
	if len(docs) == 1 && docs[0].Quota == nil {
		fmt.Fprintf(a.stdout, "tenant %s has no quota: no bound in any pool, weight 1\n", docs[0].Tenant)
		return
	}
	if len(docs) == 0 {
		fmt.Fprintln(a.stdout, "no quotas")
		return
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tWEIGHT\tQUEUE\tPOOL\tGUARANTEE\tMAX\tREVISION\tUPDATED")
	for _, d := range docs {
		q := d.Quota
		if q == nil {
			continue
		}
		queue := "fair"
		if q.StrictFIFO {
			queue = "strict-fifo"
		}
		head := fmt.Sprintf("%s\t%s\t%s\t", d.Tenant, gpus(q.EffectiveWeight()), queue)
		tail := fmt.Sprintf("\t%d\t%s", d.Revision, formatTime(&q.UpdatedAt))
		if len(q.Pools) == 0 {
			fmt.Fprintf(tw, "%s-\t-\t-%s\n", head, tail)
			continue
		}
		for i, p := range slices.Sorted(maps.Keys(q.Pools)) {
			if i > 0 {
				head, tail = "\t\t\t", "\t\t"
			}
			pq := q.Pools[p]
			maxGPUs := "-"
			if pq.Max != nil {
				maxGPUs = gpus(*pq.Max)
			}
			fmt.Fprintf(tw, "%s%s\t%s\t%s%s\n", head, p, gpus(pq.Guarantee), maxGPUs, tail)
		}
	}
	_ = tw.Flush()
}

// gpus shows a number of GPUs without trailing zeros: 8, 0.5.
func gpus(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }

// poolCmd is "pool get [POOL]", "pool set POOL --policy P" and
// "pool delete POOL" (back to the scheduler's default).
func (a *app) poolCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var policy string
	names := make([]string, len(contracts.PlacementPolicies))
	for i, p := range contracts.PlacementPolicies {
		names[i] = string(p)
	}
	fs.StringVar(&policy, "policy", "", "set: placement policy: "+strings.Join(names, ", "))
	var hostCommands, hostNetwork bool
	var roots listFlag
	fs.BoolVar(&hostCommands, "host-commands", false, "set: the pool runs host commands (jobs without an image), not only container images")
	fs.Var(&roots, "mount-roots", `set: host directories runs may mount from, comma-separated ("none": no mounts)`)
	fs.BoolVar(&hostNetwork, "host-network", false, "set: containers share the host's network (gangs need it for NCCL)")
	return func(ctx context.Context, pos, trailing []string) int {
		runtimeSet := false
		fs.Visit(func(f *flag.Flag) {
			runtimeSet = runtimeSet || f.Name == "host-commands" || f.Name == "mount-roots" || f.Name == "host-network"
		})
		usage := `want "pool get [POOL]", "pool set POOL --policy P" or "pool delete POOL"`
		if len(pos) < 1 || len(pos) > 2 || len(trailing) > 0 || !slices.Contains([]string{"get", "list", "set", "delete"}, pos[0]) {
			return a.usageErr("pool", "%s", usage)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("pool "+pos[0], err)
		}
		if len(pos) == 1 {
			if pos[0] != "get" && pos[0] != "list" {
				return a.usageErr("pool", "%s", usage)
			}
			list, err := c.Pools(ctx)
			if err != nil {
				return a.fail("pool get", err)
			}
			return a.show(list, func() { a.printPools(list.Pools) })
		}
		pool := pos[1]
		if err := contracts.ValidatePool(pool); err != nil {
			return a.usageErr("pool", "%v", err)
		}
		var doc contracts.PoolDoc
		switch pos[0] {
		case "get", "list":
			doc, err = c.Pool(ctx, pool)
		case "delete":
			doc, err = c.DeletePool(ctx, pool)
		case "set":
			if policy == "" {
				return a.usageErr("pool set", "--policy is required: one of %s", strings.Join(names, ", "))
			}
			// The pool's runtime policy is kept unless a runtime flag is
			// given; then the flags given replace it (the others off).
			var rt *contracts.PoolRuntime
			if runtimeSet {
				rt = &contracts.PoolRuntime{AllowHostCommands: hostCommands, HostNetwork: hostNetwork,
					MountRoots: slices.DeleteFunc(slices.Clone(roots), func(r string) bool { return r == "none" })}
			} else if cur, err := c.Pool(ctx, pool); err == nil && cur.Config != nil {
				rt = cur.Config.Runtime
			}
			data, _ := json.Marshal(contracts.PoolConfig{Policy: contracts.PlacementPolicy(policy), Runtime: rt})
			cfg, verr := contracts.DecodePoolConfig(data, pool)
			if verr != nil {
				return a.fail("pool set", checkedError(verr, "invalid pool config"))
			}
			doc, err = c.SetPool(ctx, pool, cfg, nil)
		}
		if err != nil {
			return a.fail("pool "+pos[0], err)
		}
		return a.show(doc, func() { a.printPools([]contracts.PoolDoc{doc}) })
	}
}

func (a *app) printPools(pools []contracts.PoolDoc) {
	if len(pools) == 0 {
		fmt.Fprintln(a.stdout, "no pools")
		return
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POOL\tPOLICY\tNODES\tREVISION\tUPDATED\tRUNTIME")
	for _, p := range pools {
		policy, rev, updated, runtime := "default", "-", "-", "default"
		if p.Config != nil {
			policy, rev, updated = string(p.Config.Policy), strconv.FormatUint(p.Revision, 10), formatTime(&p.Config.UpdatedAt)
			runtime = runtimeText(p.Config.Runtime)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", p.Pool, policy, p.Nodes, rev, updated, runtime)
	}
	_ = tw.Flush()
}

// runtimeText says a pool's runtime policy in a few words.
func runtimeText(rt *contracts.PoolRuntime) string {
	if rt == nil {
		return "default"
	}
	parts := []string{"images only"}
	if rt.AllowHostCommands {
		parts[0] = "images and host commands"
	}
	if len(rt.MountRoots) > 0 {
		parts = append(parts, "mounts from "+strings.Join(rt.MountRoots, ","))
	}
	if rt.HostNetwork {
		parts = append(parts, "host network")
	}
	return strings.Join(parts, "; ")
}

// holdCmd is cordon, drain or uncordon NODE [--gpu UUID] [--reason R]:
// with --gpu, the hold is on that one GPU of the node (a merge into the
// node's hold, which the gateway writes), and uncordon lifts only it.
func holdCmd(verb string) func(*app, *flag.FlagSet) func(context.Context, []string, []string) int {
	return func(a *app, fs *flag.FlagSet) func(context.Context, []string, []string) int {
		var reason, gpu string
		fs.StringVar(&reason, "reason", "", "why, recorded with the node's hold")
		fs.StringVar(&gpu, "gpu", "", "hold (or release) only this GPU of the node, by UUID")
		return func(ctx context.Context, pos, trailing []string) int {
			if len(pos) != 1 || len(trailing) > 0 {
				return a.usageErr(verb, "want exactly one node ID, got %d arguments", len(pos)+len(trailing))
			}
			node := pos[0]
			if err := contracts.ValidateID(node); err != nil {
				return a.usageErr(verb, "node: %v", err)
			}
			gpuSet := false
			fs.Visit(func(f *flag.Flag) { gpuSet = gpuSet || f.Name == "gpu" })
			if gpuSet {
				if err := contracts.ValidateID(gpu); err != nil {
					return a.usageErr(verb, "--gpu: invalid GPU UUID %q: want a UUID that gpuctl nodes NODE lists (GPU-...)", gpu)
				}
			}
			if reason != "" {
				body, _ := json.Marshal(contracts.NodeAdminRequest{Reason: reason})
				if _, err := contracts.DecodeNodeAdminRequest(body); err != nil {
					return a.fail(verb, checkedError(err, "invalid "+verb))
				}
			}
			c, err := a.api()
			if err != nil {
				return a.fail(verb, err)
			}
			var st contracts.NodeStatus
			if gpu != "" {
				st, err = c.HoldGPU(ctx, node, gpu, gpuplane.Hold(verb), reason)
			} else {
				st, err = c.HoldNode(ctx, node, gpuplane.Hold(verb), reason)
			}
			if err != nil {
				return a.fail(verb, err)
			}
			if a.output == "json" {
				return a.printJSON(st)
			}
			if gpu != "" {
				printGPUHold(a.stdout, node, gpu, st.Admin)
				return ExitOK
			}
			switch {
			case st.Admin == nil:
				fmt.Fprintf(a.stdout, "node %s uncordoned: it takes new work\n", node)
			case st.Admin.Drain:
				fmt.Fprintf(a.stdout, "node %s draining: no new work, its jobs are moved off%s\n", node, because(st.Admin.Reason))
			default:
				fmt.Fprintf(a.stdout, "node %s cordoned: no new work, its jobs go on%s\n", node, because(st.Admin.Reason))
			}
			return ExitOK
		}
	}
}

// printGPUHold says what one GPU's hold is now, and whether the node's
// own hold still keeps it off work.
func printGPUHold(w io.Writer, node, gpu string, a *contracts.NodeAdmin) {
	var h contracts.GPUHold
	if a != nil {
		h = a.GPUs[gpu]
	}
	switch {
	case h.Drain:
		fmt.Fprintf(w, "GPU %s of node %s draining: no new work, its runs are moved off%s\n", gpu, node, because(h.Reason))
	case h.Cordoned:
		fmt.Fprintf(w, "GPU %s of node %s cordoned: no new work, its runs go on%s\n", gpu, node, because(h.Reason))
	case a != nil && (a.Cordoned || a.Drain):
		fmt.Fprintf(w, "GPU %s of node %s uncordoned; the node itself is still %s\n", gpu, node, scheduling(a))
	default:
		fmt.Fprintf(w, "GPU %s of node %s uncordoned: it takes new work\n", gpu, node)
	}
}

func because(reason string) string {
	if reason == "" {
		return ""
	}
	return " (" + reason + ")"
}
