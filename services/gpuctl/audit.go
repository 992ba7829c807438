package gpuctl

import (
	"context"
	"flag"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// auditCmd reads the audit trail (GET /v1/audit), or checks its hash chain
// (--verify, GET /v1/audit/verify). The gateway decides what the caller
// may read: a platform admin every record, a tenant admin its tenants'.
func (a *app) auditCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var action, actor, outcome, since, until string
	var limit int
	var after uint64
	var verify, all bool
	fs.StringVar(&action, "action", "", "only this action (job.submit), or a prefix (job.*)")
	fs.StringVar(&actor, "actor", "", "only this actor: its subject (token:ci) or name")
	fs.StringVar(&outcome, "outcome", "", "only success, denied or failure")
	fs.StringVar(&since, "since", "", "from this time (RFC 3339) or this long ago (1h)")
	fs.StringVar(&until, "until", "", "before this time (RFC 3339) or this long ago")
	fs.IntVar(&limit, "limit", 100, "at most this many records (1-1000)")
	fs.Uint64Var(&after, "after", 0, "records after this stream sequence (the next page)")
	fs.BoolVar(&all, "all", false, "every record you may read, of every tenant and the platform (not only --tenant's)")
	fs.BoolVar(&verify, "verify", false, "check the whole chain instead of listing (platform admins)")
	return func(ctx context.Context, pos, trailing []string) int {
		if !a.noPositional("audit", pos, trailing) {
			return ExitUsage
		}
		if verify {
			return a.auditVerify(ctx)
		}
		q := gpuplane.AuditQuery{Action: action, Actor: actor, Outcome: outcome, Since: since, Until: until, Limit: limit, After: after}
		// Like every command, audit is about the tenant (--tenant, the
		// environment's or the login's); --all reads everything the
		// caller may, and --tenant _platform the platform's records.
		if !all {
			q.Tenant = a.tenant
		}
		for k, v := range map[string]string{"since": since, "until": until} {
			if v == "" {
				continue
			}
			if _, err := time.Parse(time.RFC3339Nano, v); err != nil {
				if d, err := time.ParseDuration(v); err != nil || d < 0 {
					return a.usageErr("audit", "--%s %q: want an RFC 3339 time or a duration such as 1h", k, v)
				}
			}
		}
		if limit < 1 || limit > 1000 {
			return a.usageErr("audit", "--limit %d: want 1 to 1000", limit)
		}
		c, err := a.api()
		if err != nil {
			return a.fail("audit", err)
		}
		list, err := c.Audit(ctx, q)
		if err != nil {
			return a.fail("audit", err)
		}
		if a.output == "json" {
			return a.printJSON(list)
		}
		a.printAudit(list)
		return ExitOK
	}
}

// printAudit prints the records as a table, oldest first.
func (a *app) printAudit(list contracts.AuditList) {
	if len(list.Records) == 0 {
		fmt.Fprintln(a.stdout, "no audit records")
		return
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SEQ\tTIME\tACTOR\tACTION\tTENANT\tOBJECT\tOUTCOME\tREASON\tSOURCE")
	for _, e := range list.Records {
		actor := e.Actor
		if e.ActorName != "" && !strings.HasSuffix(actor, ":"+e.ActorName) {
			actor += " (" + e.ActorName + ")"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", e.Seq, e.Time.UTC().Format(time.RFC3339), actor, e.Action,
			dash(e.Tenant), dash(e.Object), e.Outcome, dash(string(e.Reason)), dash(e.Source))
	}
	_ = tw.Flush()
	if list.More {
		fmt.Fprintf(a.stdout, "more records follow: --after %d\n", list.Records[len(list.Records)-1].Seq)
	}
}

// auditVerify checks the chain and exits 1 when it does not hold.
func (a *app) auditVerify(ctx context.Context) int {
	c, err := a.api()
	if err != nil {
		return a.fail("audit", err)
	}
	v, err := c.VerifyAudit(ctx)
	if err != nil {
		return a.fail("audit", err)
	}
	if a.output == "json" {
		if code := a.printJSON(v); code != ExitOK || v.OK {
			return code
		}
		return ExitError
	}
	if v.OK {
		fmt.Fprintf(a.stdout, "audit chain intact: %d records, last seq %d, hash %s\n", v.Records, v.LastSeq, v.LastHash)
		fmt.Fprintln(a.stdout, "keep the last hash elsewhere: a chain cannot show records cut off after it")
		return ExitOK
	}
	fmt.Fprintf(a.stdout, "audit chain BROKEN: %d records, %d breaks\n", v.Records, len(v.Breaks))
	for _, b := range v.Breaks {
		fmt.Fprintf(a.stdout, "  seq %d %s: %s\n", b.Seq, b.ID, b.Reason)
	}
	return ExitError
}
