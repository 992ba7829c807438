package gpuctl

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// busTimeout bounds connecting to NATS and one publish with --via bus
// (the bus retries a publish until then, e.g. while streams are missing).
const busTimeout = 15 * time.Second

// requestFlags are the names of the flags that build a job request, which
// -f excludes: read off register, so a new request flag is never missed.
var requestFlags = func() []string {
	fs := flag.NewFlagSet("request", flag.ContinueOnError)
	new(submitFlags).register(fs)
	var names []string
	fs.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	return names
}()

// submitFlags are the flags that build a job request.
type submitFlags struct {
	name, model, priority, pool, duration    string
	mig, share, topology, cpu, memory        string
	expected, placementTimeout               string
	image, workdir, user, shm                string
	mounts, env                              listFlag
	gpus, nodes, exitCode                    int
	gpuMemory                                int64
	checkpoint                               bool
	models, dependsOn, selector, tolerations listFlag
}

// listFlag is a flag that may be repeated, each value also split at
// commas: --models L4,T4 --models A100-80GB.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	for _, e := range strings.Split(v, ",") {
		if e = strings.TrimSpace(e); e != "" {
			*l = append(*l, e)
		}
	}
	return nil
}

func (f *submitFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.name, "name", "", "job name")
	fs.IntVar(&f.gpus, "gpus", 1, "number of whole GPUs (in all, over --nodes machines)")
	fs.StringVar(&f.model, "model", contracts.GPUModelAny, fmt.Sprintf("GPU model: %s or one of %s", contracts.GPUModelAny, strings.Join(contracts.GPUModels, ", ")))
	fs.Var(&f.models, "models", "allowed GPU models instead of one --model, comma-separated (H100-80GB,A100-80GB)")
	fs.Int64Var(&f.gpuMemory, "gpu-memory", 0, "minimum memory per GPU in MiB")
	fs.StringVar(&f.mig, "mig", "", "one MIG instance of this profile (1g.10gb, 3g.40gb, ...) instead of whole GPUs")
	fs.StringVar(&f.share, "share", "", "a share of one GPU, MEMORY:PERCENT: framebuffer (MiB, or 4Gi) and compute percent (4096:25)")
	fs.IntVar(&f.nodes, "nodes", 0, "spread --gpus evenly over this many machines, placed all or nothing")
	fs.StringVar(&f.topology, "topology", "", "nvlink (each machine's GPUs in one NVLink domain) or zone (all machines in one zone)")
	fs.StringVar(&f.cpu, "cpu", "", "CPU per machine: cores (4, 0.5) or millicores (500m)")
	fs.StringVar(&f.memory, "memory", "", "host memory per machine: MiB (65536) or with a unit (64Gi, 512Mi, 1Ti)")
	fs.StringVar(&f.priority, "priority", "", "critical, high, normal (default) or best-effort")
	fs.StringVar(&f.pool, "pool", "", "restrict placement to one node pool")
	fs.Var(&f.selector, "selector", "only nodes with this label, KEY=VALUE (repeatable, or comma-separated)")
	fs.Var(&f.tolerations, "toleration", "tolerate a taint: KEY=VALUE[:EFFECT] or KEY:Exists[:EFFECT] (:Exists alone: every taint; repeatable)")
	fs.Var(&f.dependsOn, "depends-on", "job IDs of the tenant that must succeed first, comma-separated")
	fs.StringVar(&f.expected, "expected", "", "how long the job expects to run (e.g. 2h): lets backfill place it early")
	fs.StringVar(&f.placementTimeout, "placement-timeout", "", "fail the job if it is not placed within this time (e.g. 30m)")
	fs.StringVar(&f.duration, "duration", "30s", "a simulated run's length; with a command after --, a time limit (only when given)")
	fs.IntVar(&f.exitCode, "exit-code", 0, "exit code the simulated run ends with")
	fs.StringVar(&f.image, "image", "", "run in a container of this OCI image (a tag or a digest); a command after -- replaces its ENTRYPOINT")
	fs.StringVar(&f.workdir, "workdir", "", "the container's working directory (default the image's)")
	fs.StringVar(&f.user, "user", "", "run the container as UID[:GID] or a NAME[:GROUP] of the image (default the image's user)")
	fs.StringVar(&f.shm, "shm-size", "", "size of the container's /dev/shm: MiB (1024) or with a unit (1Gi)")
	fs.Var(&f.mounts, "mount", "mount a host path of the pool's mount roots: SOURCE:TARGET[:ro] (repeatable)")
	fs.Var(&f.env, "env", "an environment variable of the run, KEY=VALUE (repeatable, or comma-separated)")
	fs.BoolVar(&f.checkpoint, "checkpoint", false, "the job implements the checkpoint protocol (SIGUSR1, GPUPLANE_CHECKPOINT_DIR; see FLOWS.md)")
}

func (a *app) submitCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var (
		file, id string
		watch    bool
		f        submitFlags
	)
	fs.StringVar(&file, "f", "", "read the JobRequest from a YAML or JSON file (- for stdin)")
	fs.StringVar(&id, "id", "", "job ID (default: a new time-ordered ID); also the submit's Nats-Msg-Id")
	fs.BoolVar(&watch, "watch", false, "then watch the job until it ends (exit code as for watch)")
	f.register(fs)
	return func(ctx context.Context, pos, trailing []string) int {
		if len(pos) > 0 {
			return a.usageErr("submit", "unexpected arguments %q (a command goes after --)", pos)
		}
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		var (
			doc []byte
			err error
		)
		if file != "" {
			var conflict []string
			for _, f := range requestFlags {
				if set[f] {
					conflict = append(conflict, "--"+f)
				}
			}
			if len(conflict) > 0 || len(trailing) > 0 {
				return a.usageErr("submit", "-f cannot be combined with %s; put those fields in the file", strings.Join(append(conflict, trailing...), " "))
			}
			if doc, err = readRequestFile(file); err != nil {
				return a.fail("submit", err)
			}
		} else if doc, err = f.request(set["duration"], trailing); err != nil {
			return a.usageErr("submit", "%v", err)
		}
		if doc, err = withID(doc, id); err != nil {
			return a.fail("submit", err)
		}
		// The same validation the gateway and the scheduler apply.
		req, err := contracts.DecodeJobRequest(doc, a.tenant)
		if err != nil {
			return a.fail("submit", localError(err))
		}
		res, err := a.submit(ctx, req, doc)
		if err != nil {
			return a.fail("submit", err)
		}
		if a.output == "json" {
			if code := a.printJSON(res); code != ExitOK || !watch {
				return code
			}
			return a.watch(ctx, res.JobID)
		}
		if res.Duplicate {
			fmt.Fprintf(a.stdout, "job %s was already submitted (tenant %s, %s #%d): duplicate ignored\n", res.JobID, res.Tenant, res.Stream, res.Sequence)
		} else {
			fmt.Fprintf(a.stdout, "job %s submitted (tenant %s, %s #%d)\n", res.JobID, res.Tenant, res.Stream, res.Sequence)
		}
		if watch {
			return a.watch(ctx, res.JobID)
		}
		return ExitOK
	}
}

// request builds the request document from the flags. It is JSON, so
// that it goes through exactly the decoding a posted body does: the
// values are checked there (a bad duration or MIG profile is reported on
// its field); only what cannot be written as JSON at all (a --share
// without its colon) is refused here.
func (f *submitFlags) request(durationSet bool, command []string) ([]byte, error) {
	var errs []error
	gpu := map[string]any{"count": f.gpus}
	if f.model != "" {
		gpu["model"] = f.model
	}
	if len(f.models) > 0 {
		gpu["models"] = []string(f.models)
	}
	if f.gpuMemory != 0 {
		gpu["memoryMiB"] = f.gpuMemory
	}
	if f.mig != "" {
		gpu["migProfile"] = f.mig
	}
	if f.share != "" {
		mem, pct, err := parseShare(f.share)
		errs = append(errs, err)
		gpu["share"] = map[string]any{"memoryMiB": mem, "computePercent": pct}
	}
	if f.nodes != 0 {
		gpu["nodes"] = f.nodes
	}
	if f.topology != "" {
		gpu["topology"] = f.topology
	}
	resources := map[string]any{"gpu": gpu}
	if f.cpu != "" {
		milli, err := parseCPU(f.cpu)
		errs = append(errs, err)
		resources["cpuMilli"] = milli
	}
	if f.memory != "" {
		mib, err := parseMiB(f.memory)
		errs = append(errs, err)
		resources["memoryMiB"] = mib
	}
	run := map[string]any{}
	if len(command) > 0 {
		run["command"] = command
	}
	// A simulated run's length by default; for a command or an image, a
	// time limit only when asked for.
	if len(command) == 0 && f.image == "" || durationSet {
		run["duration"] = f.duration
	}
	if f.image != "" {
		run["image"] = f.image
	}
	if f.workdir != "" {
		run["workingDir"] = f.workdir
	}
	if f.user != "" {
		run["user"] = f.user
	}
	if f.shm != "" {
		mib, err := parseMiB(f.shm)
		errs = append(errs, err)
		run["shmSizeMiB"] = mib
	}
	if len(f.mounts) > 0 {
		mounts := make([]contracts.Mount, 0, len(f.mounts))
		for _, m := range f.mounts {
			mount, err := parseMount(m)
			errs = append(errs, err)
			mounts = append(mounts, mount)
		}
		run["mounts"] = mounts
	}
	if len(f.env) > 0 {
		env := map[string]string{}
		for _, kv := range f.env {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				errs = append(errs, fmt.Errorf("--env %q: want KEY=VALUE", kv))
				continue
			}
			env[k] = v
		}
		run["env"] = env
	}
	if f.checkpoint {
		run["checkpoint"] = true
	}
	if f.exitCode != 0 {
		run["exitCode"] = f.exitCode
	}
	doc := map[string]any{"resources": resources, "run": run}
	for k, v := range map[string]string{"name": f.name, "priority": f.priority, "pool": f.pool,
		"expectedRunTime": f.expected, "placementTimeout": f.placementTimeout} {
		if v != "" {
			doc[k] = v
		}
	}
	if len(f.selector) > 0 {
		sel := map[string]string{}
		for _, kv := range f.selector {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				errs = append(errs, fmt.Errorf("--selector %q: want KEY=VALUE", kv))
				continue
			}
			sel[k] = v
		}
		doc["nodeSelector"] = sel
	}
	if len(f.tolerations) > 0 {
		tols := make([]contracts.Toleration, 0, len(f.tolerations))
		for _, t := range f.tolerations {
			tol, err := parseToleration(t)
			errs = append(errs, err)
			tols = append(tols, tol)
		}
		doc["tolerations"] = tols
	}
	if len(f.dependsOn) > 0 {
		doc["dependsOn"] = []string(f.dependsOn)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return json.Marshal(doc)
}

// parseMount reads --mount SOURCE:TARGET[:ro|:rw]; the paths are checked
// with the rest of the request (and the source against the pool's roots
// by the scheduler).
func parseMount(s string) (contracts.Mount, error) {
	parts := strings.Split(s, ":")
	m := contracts.Mount{}
	switch {
	case len(parts) == 3 && (parts[2] == "ro" || parts[2] == "rw"):
		m.ReadOnly = parts[2] == "ro"
	case len(parts) != 2:
		return m, fmt.Errorf("--mount %q: want SOURCE:TARGET or SOURCE:TARGET:ro", s)
	}
	m.Source, m.Target = parts[0], parts[1]
	return m, nil
}

// parseShare reads --share MEMORY:PERCENT.
func parseShare(s string) (int64, int, error) {
	m, p, ok := strings.Cut(s, ":")
	if !ok {
		return 0, 0, fmt.Errorf("--share %q: want MEMORY:PERCENT, e.g. 4096:25 or 4Gi:25", s)
	}
	mem, err := parseMiB(m)
	if err != nil {
		return 0, 0, fmt.Errorf("--share %q: %w", s, err)
	}
	pct, err := strconv.Atoi(strings.TrimSuffix(p, "%"))
	if err != nil {
		return 0, 0, fmt.Errorf("--share %q: compute percent %q is not a whole number", s, p)
	}
	return mem, pct, nil
}

// parseCPU reads cores ("4", "0.5") or millicores ("500m").
func parseCPU(s string) (int64, error) {
	if m, ok := strings.CutSuffix(s, "m"); ok {
		n, err := strconv.ParseInt(m, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("--cpu %q: want cores (4, 0.5) or millicores (500m)", s)
		}
		return n, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != f || f > 1e9 || f < -1e9 {
		return 0, fmt.Errorf("--cpu %q: want cores (4, 0.5) or millicores (500m)", s)
	}
	return int64(f*1000 + 0.5*sign(f)), nil
}

func sign(f float64) float64 {
	if f < 0 {
		return -1
	}
	return 1
}

// memUnits are the binary units memory flags take, in MiB.
var memUnits = []struct {
	suffix string
	mib    int64
}{{"Ti", 1 << 20}, {"Gi", 1 << 10}, {"Mi", 1}}

// parseMiB reads MiB ("65536") or a binary unit ("64Gi", "512Mi", "1Ti").
func parseMiB(s string) (int64, error) {
	mult, num := int64(1), s
	for _, u := range memUnits {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			mult, num = u.mib, n
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n > (1<<62)/mult || n < -(1<<62)/mult {
		return 0, fmt.Errorf("memory %q: want MiB (65536) or a whole number with Mi, Gi or Ti (64Gi)", s)
	}
	return n * mult, nil
}

// parseToleration reads KEY=VALUE[:EFFECT] (operator Equal) or
// KEY:Exists[:EFFECT] (operator Exists; an empty KEY tolerates every
// taint). The effect's value is checked with the rest of the request.
func parseToleration(s string) (contracts.Toleration, error) {
	bad := fmt.Errorf("--toleration %q: want KEY=VALUE[:EFFECT] or KEY:Exists[:EFFECT]", s)
	if k, v, ok := strings.Cut(s, "="); ok {
		if k == "" || strings.Contains(k, ":") {
			return contracts.Toleration{}, bad
		}
		value, effect, _ := strings.Cut(v, ":")
		return contracts.Toleration{Key: k, Operator: contracts.TolerationEqual, Value: value, Effect: contracts.TaintEffect(effect)}, nil
	}
	parts := strings.Split(s, ":")
	if len(parts) < 2 || len(parts) > 3 || parts[1] != string(contracts.TolerationExists) {
		return contracts.Toleration{}, bad
	}
	t := contracts.Toleration{Key: parts[0], Operator: contracts.TolerationExists}
	if len(parts) == 3 {
		t.Effect = contracts.TaintEffect(parts[2])
	}
	return t, nil
}

// readRequestFile reads a JobRequest document: JSON as is (a .json file),
// anything else as YAML converted to JSON, so both are validated by
// contracts.DecodeJobRequest exactly like a posted body.
func readRequestFile(path string) ([]byte, error) {
	var data []byte
	var err error
	if path == "-" {
		data, err = io.ReadAll(io.LimitReader(os.Stdin, 4*contracts.MaxMessageBytes))
	} else {
		data, err = os.ReadFile(path)
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if strings.EqualFold(filepath.Ext(path), ".json") {
		return data, nil
	}
	out, err := yamlToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// yamlToJSON converts one YAML document to JSON. Mapping keys must be
// strings; scalars keep their YAML types (so "count: two" still fails as
// invalid_type when the JSON is decoded), except that timestamps stay the
// strings they were written as. An empty document is an empty body.
func yamlToJSON(data []byte) ([]byte, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("invalid YAML: %w", err)
	}
	if doc.Kind == 0 || len(doc.Content) == 0 {
		return nil, nil
	}
	v, err := jsonValue(doc.Content[0], "")
	if err != nil {
		return nil, err
	}
	out, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("YAML to JSON: %w", err)
	}
	return out, nil
}

func jsonValue(n *yaml.Node, path string) (any, error) {
	at := func() string {
		if path == "" {
			return "the top level"
		}
		return strings.TrimPrefix(path, ".")
	}
	switch n.Kind {
	case yaml.AliasNode:
		return jsonValue(n.Alias, path)
	case yaml.MappingNode:
		m := make(map[string]any, len(n.Content)/2)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			if k.Kind != yaml.ScalarNode || k.ShortTag() != "!!str" {
				return nil, fmt.Errorf("YAML key %q at %s is not a string", k.Value, at())
			}
			v, err := jsonValue(n.Content[i+1], path+"."+k.Value)
			if err != nil {
				return nil, err
			}
			m[k.Value] = v
		}
		return m, nil
	case yaml.SequenceNode:
		out := make([]any, len(n.Content))
		for i, e := range n.Content {
			v, err := jsonValue(e, fmt.Sprintf("%s[%d]", path, i))
			if err != nil {
				return nil, err
			}
			out[i] = v
		}
		return out, nil
	case yaml.ScalarNode:
		switch n.ShortTag() {
		case "!!str", "!!timestamp":
			return n.Value, nil
		}
		var v any
		if err := n.Decode(&v); err != nil {
			return nil, fmt.Errorf("YAML value at %s: %w", at(), err)
		}
		return v, nil
	}
	return nil, fmt.Errorf("unsupported YAML node at %s", at())
}

// withID sets the document's id to id, or to a new time-ordered ID when
// id is empty and the document has none (so a retried submit of the same
// document is not a duplicate, but a retried command with --id is). A
// document that is not a JSON object is left alone for the decoder to
// reject.
func withID(doc []byte, id string) ([]byte, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(doc, &obj); err != nil || obj == nil {
		return doc, nil
	}
	if id == "" {
		if cur, ok := obj["id"]; ok && string(cur) != `""` && string(cur) != "null" {
			return doc, nil
		}
		id = contracts.NewJobID()
	}
	raw, _ := json.Marshal(id)
	obj["id"] = raw
	out, err := json.Marshal(obj)
	if err != nil {
		return nil, fmt.Errorf("setting the job id: %w", err)
	}
	return out, nil
}

// localError presents a validation failure found before sending anything
// as the gateway would have answered it.
func localError(err error) error {
	return gpuplane.ValidationError(err, "invalid job request (checked before sending)")
}

// submit sends a validated request over the chosen transport.
func (a *app) submit(ctx context.Context, req contracts.JobRequest, doc []byte) (contracts.SubmitResponse, error) {
	if a.via == viaBus {
		return a.publish(ctx, contracts.SubjectSubmit(a.tenant), contracts.SubmitMsgID(a.tenant, req.ID), req.ID, doc, contracts.CEType(req))
	}
	c, err := a.api()
	if err != nil {
		return contracts.SubmitResponse{}, err
	}
	// The document as written (its ID set by withID, so a retry of the
	// request is the same job).
	return c.SubmitJSON(ctx, a.tenant, doc)
}

func (a *app) cancelCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var reason string
	fs.StringVar(&reason, "reason", "", "why, recorded with the cancel request")
	return func(ctx context.Context, pos, trailing []string) int {
		id, ok := a.onePositional("cancel", pos, trailing)
		if !ok {
			return ExitUsage
		}
		if err := checkNames(a.tenant, id); err != nil {
			return a.usageErr("cancel", "%v", err)
		}
		var res contracts.SubmitResponse
		var err error
		if a.via == viaBus {
			// No read model here: the scheduler ignores a cancel of an
			// unknown or finished job.
			cr := contracts.CancelRequest{SchemaVersion: contracts.SchemaVersion, JobID: id, Reason: reason}
			data, _ := json.Marshal(cr)
			res, err = a.publish(ctx, contracts.SubjectCancel(a.tenant), contracts.CancelMsgID(a.tenant, id), id, data, contracts.CEType(cr))
		} else {
			var c *gpuplane.Client
			if c, err = a.api(); err == nil {
				res, err = c.CancelJob(ctx, a.tenant, id, reason)
			}
		}
		if err != nil {
			return a.fail("cancel", err)
		}
		if a.output == "json" {
			return a.printJSON(res)
		}
		dup := ""
		if res.Duplicate {
			dup = " (already requested)"
		}
		fmt.Fprintf(a.stdout, "cancel of job %s requested%s (tenant %s, %s #%d)\n", res.JobID, dup, res.Tenant, res.Stream, res.Sequence)
		return ExitOK
	}
}

// checkNames validates a tenant and job ID before they become subject
// tokens or path elements.
func checkNames(tenant, id string) error {
	return errors.Join(contracts.ValidateTenant(tenant), contracts.ValidateID(id))
}

// connectBus connects for --via bus with the --creds identity, without
// provisioning streams: the platform's services own them.
func (a *app) connectBus(ctx context.Context) (*bus.Bus, error) {
	b, err := bus.Connect(ctx, bus.Config{
		URL: a.nats, Name: "gpuctl", CredsFile: a.creds, SkipProvision: true, ConnectTimeout: busTimeout,
		Logger: slog.New(slog.NewTextHandler(a.stderr, &slog.HandlerOptions{Level: slog.LevelError})),
	})
	if err != nil {
		return nil, err
	}
	return b, nil
}

// publish publishes data on subject with message ID msgID, straight on
// JetStream, and answers like the gateway would.
func (a *app) publish(ctx context.Context, subject, msgID, jobID string, data []byte, ceType string) (contracts.SubmitResponse, error) {
	b, err := a.connectBus(ctx)
	if err != nil {
		return contracts.SubmitResponse{}, err
	}
	defer closeBus(b)
	pctx, cancel := context.WithTimeout(ctx, busTimeout)
	defer cancel()
	ack, err := b.PublishRaw(pctx, subject, msgID, data, bus.CEType(ceType), bus.CESubject(jobID))
	if err != nil {
		return contracts.SubmitResponse{}, err
	}
	return contracts.SubmitResponse{Tenant: a.tenant, JobID: jobID, Stream: ack.Stream, Sequence: ack.Sequence, Duplicate: ack.Duplicate}, nil
}

func closeBus(b *bus.Bus) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = b.Close(ctx)
}

func (a *app) printJSON(v any) int {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return a.fail("output", err)
	}
	return ExitOK
}
