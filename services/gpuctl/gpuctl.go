// Package gpuctl is gpuplane's command-line client: submit, inspect,
// describe, cancel and watch jobs, read their output, ask them to
// checkpoint, list, cordon and drain nodes, inject faults, and edit
// quotas, pools, prices and budgets through the gateway's REST API, or submit,
// cancel and watch straight on the bus (--via bus). The binary is
// cmd/gpuctl; Run is the whole program, so tests drive it without exiting.
package gpuctl

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// Exit codes.
const (
	ExitOK    = 0 // done; for watch, the job succeeded
	ExitError = 1 // the request failed, or the watched job failed, was cancelled or rejected
	ExitUsage = 2 // bad command line
)

// Transports of --via.
const (
	viaGateway = "gateway"
	viaBus     = "bus"
)

const usageText = `gpuctl submits, inspects and watches gpuplane jobs.

Usage:
  gpuctl [common flags] <command> [flags] [args]

Commands:
  submit [flags] [-- command args...]   submit a job from flags, or from -f job.yaml|job.json: whole GPUs
                                         (--gpus, --model, --models, --nodes N --topology nvlink|zone), a MIG
                                         instance (--mig 1g.10gb), a GPU share (--share 4096:25); --cpu,
                                         --memory, --selector k=v, --toleration k=v:Effect|k:Exists,
                                         --depends-on a,b, --expected 2h, --placement-timeout 30m; a container:
                                         --image REF [-- cmd args] (--workdir, --user, --shm-size,
                                         --mount SRC:DST[:ro], --env K=V)
  get ID                                 show one job
  describe ID                            everything about one job: why it is pending, where it runs, its events
  list [--state S] [--limit N] [--after ID]
                                         list the tenant's jobs, newest first; --after the last ID shown: the next page
  cancel ID [--reason TEXT]              ask to cancel a job
  watch ID                               print the job's events until it ends (exit 0 only if it succeeded)
  logs ID [-f] [--attempt N|all] [--rank N]
                                         print the job's output (latest attempt; of machine N of a
                                         multi-machine job, default 0); -f follows it to the end
  checkpoint ID                          ask the job's running process to write a checkpoint
  usage                                  show the tenant's metered GPU usage and its cost (-o csv too)
  invoice [--period YYYY-MM]             the tenant's invoice: on-demand, spot, reserved, spot savings (-o csv too)
  prices get | set -f book.yaml          show or replace the price book (admin)
  budget get | set --limit L [--period monthly|daily] [--policy notify|reject|spot-only] | delete
                                         the tenant's budget and its status (set and delete: admin)
  nodes [NODE] [--pool P]                list the nodes, or show one: GPUs, MIG, health, topology
  fault inject NODE --kind K [flags]     inject a fault into a simulated node (admin): xid, ecc_dbe,
                                         overheat, machine_death, agent_pause or clear
  cordon|drain|uncordon NODE [--gpu UUID] [--reason R]
                                         stop new work on a node (or one GPU of it, --gpu); drain also
                                         moves its jobs off; uncordon --gpu lifts that GPU's hold (admin)
  quota get | list | set [--pool P] [--guarantee G] [--max M|none] [--weight W] [--strict-fifo] | delete
                                         the tenant's GPU quota per pool and fair-share weight (set, delete: admin)
  pool get [POOL] | set POOL --policy binpack|spread|topology|fragaware | delete POOL
       [--host-commands] [--mount-roots DIRS] [--host-network]
                                         the pools, their placement policy and what they run: images only
                                         unless --host-commands (set, delete: admin)
  audit [--all] [--action A] [--actor X] [--outcome O] [--since 1h] [--until T] [--verify]
                                         the tenant's audit trail (tenant admins), --all of everything you
                                         may read, --tenant _platform the platform's; --verify checks its
                                         hash chain (platform admins)
  login [--token T | --user U [--password-file F] | --oidc]
                                         log in to the gateway and store the credentials (0600) under the
                                         user's config directory; every command sends them
  logout                                 forget the gateway's credentials
  whoami                                 who the gateway takes you for, and your roles
  token create --name N --role R [--tenant T] [--ttl D] | list | revoke ID
                                         API tokens for automation (the secret is shown once)
  role bind|unbind SUBJECT --role R [--tenant T] | list [--tenant T]
                                         role bindings: platform-admin, tenant-admin, member, viewer
  registry login HOST --username U | --token | logout HOST | list
                                         the tenant's image registry logins, secret read from stdin
                                         (platform admins, on the bus: --creds of a bus admin)

Common flags (before or after the command):
  --tenant T     tenant (env GPUPLANE_TENANT, else the login's, default "default")
  --gateway URL  gateway base URL (env GPUPLANE_GATEWAY, else the last login's, default http://127.0.0.1:8080)
  --ca-cert F    PEM file of the CA of the gateway's TLS certificate (env GPUPLANE_CA_CERT)
  --via V        gateway or bus: submit, cancel and watch straight on NATS (the other commands always use the gateway)
  --nats URL     NATS URL for --via bus (env GPUPLANE_NATS_URL, default nats://127.0.0.1:4222)
  --creds F      NATS creds file of your bus identity for --via bus (env GPUPLANE_NATS_CREDS)
  -o FORMAT      table (default) or json; csv for usage and invoice

Run "gpuctl <command> -h" for a command's flags.
`

// env is how Run reads the environment (os.Getenv in the binary).
type env func(string) string

// common are the flags every command takes.
type common struct {
	tenant  string
	gateway string
	via     string
	nats    string
	// creds is the NATS creds file for --via bus: the server refuses a
	// connection without one, and a tenant's may only submit, cancel and
	// read its own tenant's jobs.
	creds  string
	output string
	caCert string
	// token is GPUPLANE_TOKEN: it overrides the stored credentials.
	token string
	// configDir holds the credentials (ConfigDir); "" when there is none.
	configDir string
	// traceParent is TRACEPARENT: the caller's trace, which requests join.
	traceParent string
}

func defaults(getenv env) common {
	or := func(k, d string) string {
		if v := getenv(k); v != "" {
			return v
		}
		return d
	}
	c := common{
		via:    viaGateway,
		nats:   or("GPUPLANE_NATS_URL", "nats://127.0.0.1:4222"),
		creds:  getenv("GPUPLANE_NATS_CREDS"),
		output: "table",
		caCert: getenv("GPUPLANE_CA_CERT"),
		token:  getenv("GPUPLANE_TOKEN"),
		// The caller's trace, if it is in one (trace.go).
		traceParent: getenv(EnvTraceParent),
	}
	// The last login names the default gateway and tenant.
	c.configDir, _ = ConfigDir(getenv)
	creds, _ := LoadCredentials(c.configDir)
	c.gateway = or("GPUPLANE_GATEWAY", cmp.Or(creds.Current, "http://127.0.0.1:8080"))
	login := creds.Gateways[normalizeGateway(c.gateway)]
	c.tenant = or("GPUPLANE_TENANT", cmp.Or(login.Tenant, "default"))
	if c.caCert == "" {
		c.caCert = login.CACert
	}
	return c
}

// register adds the common flags to fs, defaulting to the current values
// (so flags given before the command carry over).
func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.tenant, "tenant", c.tenant, "tenant (env GPUPLANE_TENANT)")
	fs.StringVar(&c.gateway, "gateway", c.gateway, "gateway base URL (env GPUPLANE_GATEWAY)")
	fs.StringVar(&c.via, "via", c.via, "transport for submit, cancel and watch: gateway or bus")
	fs.StringVar(&c.nats, "nats", c.nats, "NATS URL for --via bus (env GPUPLANE_NATS_URL)")
	fs.StringVar(&c.creds, "creds", c.creds, "NATS creds file for --via bus (env GPUPLANE_NATS_CREDS)")
	fs.StringVar(&c.output, "o", c.output, "output format: table or json (csv for usage and invoice)")
	fs.StringVar(&c.caCert, "ca-cert", c.caCert, "PEM file of the CA of the gateway's TLS certificate (env GPUPLANE_CA_CERT)")
}

func (c *common) validate() error {
	var errs []error
	if c.via != viaGateway && c.via != viaBus {
		errs = append(errs, fmt.Errorf("--via %q: want gateway or bus", c.via))
	}
	if c.output != "table" && c.output != "json" && c.output != "csv" {
		errs = append(errs, fmt.Errorf("-o %q: want table, json or csv", c.output))
	}
	if c.gateway == "" {
		errs = append(errs, errors.New("--gateway is empty"))
	}
	return errors.Join(errs...)
}

// app is one invocation.
type app struct {
	common
	stdout, stderr io.Writer
	// stdin is where login reads a password (os.Stdin in the binary).
	stdin io.Reader
	// traceID is the W3C trace of every request of this command (trace.go).
	traceID string
}

// command is one subcommand: it registers its flags, then runs with the
// positional arguments and the arguments after "--".
type command struct {
	name  string
	args  string // positional arguments, for the usage line
	flags func(a *app, fs *flag.FlagSet) func(ctx context.Context, pos, trailing []string) int
}

var commands = []command{
	{"submit", "[-- command args...]", (*app).submitCmd},
	{"get", "ID", (*app).getCmd},
	{"list", "", (*app).listCmd},
	{"cancel", "ID", (*app).cancelCmd},
	{"watch", "ID", (*app).watchCmd},
	{"usage", "", (*app).usageCmd},
	{"invoice", "", (*app).invoiceCmd},
	{"prices", "get|set", (*app).pricesCmd},
	{"budget", "get|set|delete", (*app).budgetCmd},
	{"logs", "ID", (*app).logsCmd},
	{"checkpoint", "ID", (*app).checkpointCmd},
	{"nodes", "[NODE]", (*app).nodesCmd},
	{"fault", "inject NODE", (*app).faultCmd},
	{"describe", "ID", (*app).describeCmd},
	{"quota", "get|list|set|delete", (*app).quotaCmd},
	{"pool", "get [POOL]|set POOL|delete POOL", (*app).poolCmd},
	{"cordon", "NODE", holdCmd("cordon")},
	{"drain", "NODE", holdCmd("drain")},
	{"uncordon", "NODE", holdCmd("uncordon")},
	{"audit", "", (*app).auditCmd},
	{"login", "", (*app).loginCmd},
	{"logout", "", (*app).logoutCmd},
	{"whoami", "", (*app).whoamiCmd},
	{"token", "create|list|revoke ID", (*app).tokenCmd},
	{"role", "bind|unbind SUBJECT|list", (*app).roleCmd},
	{"registry", "login HOST|logout HOST|list", (*app).registryCmd},
}

// Run runs gpuctl with args (without the program name) and returns the
// exit code. It never exits the process.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	a := &app{common: defaults(getenv), stdout: stdout, stderr: stderr, stdin: os.Stdin}
	top := flag.NewFlagSet("gpuctl", flag.ContinueOnError)
	top.SetOutput(stderr)
	top.Usage = func() { fmt.Fprint(stderr, usageText) }
	a.register(top)
	if err := top.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK
		}
		return ExitUsage
	}
	if top.NArg() == 0 || top.Arg(0) == "help" {
		fmt.Fprint(stderr, usageText)
		if top.NArg() == 0 {
			return ExitUsage
		}
		return ExitOK
	}
	name, rest := top.Arg(0), top.Args()[1:]
	i := slices.IndexFunc(commands, func(c command) bool { return c.name == name })
	if i < 0 {
		fmt.Fprintf(stderr, "gpuctl: unknown command %q\n\n%s", name, usageText)
		return ExitUsage
	}
	cmd := commands[i]
	fs := flag.NewFlagSet("gpuctl "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	a.register(fs)
	run := cmd.flags(a, fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: gpuctl %s [flags] %s\n\nFlags:\n", name, cmd.args)
		fs.PrintDefaults()
	}
	pos, trailing, err := parseInterspersed(fs, rest)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK
		}
		return ExitUsage
	}
	if err := a.validate(); err != nil {
		fmt.Fprintf(stderr, "gpuctl %s: %v\n", name, err)
		return ExitUsage
	}
	if a.output == "csv" && name != "usage" && name != "invoice" {
		fmt.Fprintf(stderr, "gpuctl %s: -o csv is for usage and invoice; want table or json\n", name)
		return ExitUsage
	}
	return run(ctx, pos, trailing)
}

// parseInterspersed parses flags anywhere among the positional arguments
// ("gpuctl get ID -o json"); what follows a "--" is returned apart,
// untouched.
func parseInterspersed(fs *flag.FlagSet, args []string) (pos, trailing []string, err error) {
	if i := slices.Index(args, "--"); i >= 0 {
		args, trailing = args[:i], args[i+1:]
	}
	for {
		if err := fs.Parse(args); err != nil {
			return nil, nil, err
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, trailing, nil
		}
		pos, args = append(pos, args[0]), args[1:]
	}
}

// usageErr prints a usage problem and returns ExitUsage.
func (a *app) usageErr(cmd, format string, args ...any) int {
	fmt.Fprintf(a.stderr, "gpuctl %s: %s\n", cmd, fmt.Sprintf(format, args...))
	return ExitUsage
}

// fail prints err (an API error with its reason and field errors) and
// returns ExitError.
func (a *app) fail(cmd string, err error) int {
	var b strings.Builder
	fmt.Fprintf(&b, "gpuctl %s: %v\n", cmd, err)
	if ae, ok := gpuplane.AsAPIError(err); ok {
		if ae.StatusCode == 401 && cmd != "login" {
			fmt.Fprintf(&b, "  log in with gpuctl login (or set GPUPLANE_TOKEN)\n")
		}
		for _, f := range ae.Fields {
			if f.Field != "" {
				fmt.Fprintf(&b, "  %s: %s: %s\n", f.Field, f.Reason, f.Message)
			} else {
				fmt.Fprintf(&b, "  %s: %s\n", f.Reason, f.Message)
			}
		}
	}
	fmt.Fprint(a.stderr, b.String())
	return ExitError
}

// onePositional checks that exactly one positional argument (an ID) was given.
func (a *app) onePositional(cmd string, pos, trailing []string) (string, bool) {
	if len(pos) != 1 || len(trailing) > 0 {
		a.usageErr(cmd, "want exactly one job ID, got %d arguments", len(pos)+len(trailing))
		return "", false
	}
	return pos[0], true
}

func (a *app) noPositional(cmd string, pos, trailing []string) bool {
	if len(pos)+len(trailing) > 0 {
		a.usageErr(cmd, "unexpected arguments %q", append(pos, trailing...))
		return false
	}
	return true
}
