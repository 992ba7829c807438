package gpuctl

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// busTimeout bounds connecting to NATS and one publish with --via bus
// (the bus retries a publish until then, e.g. while streams are missing).
const busTimeout = 15 * time.Second

// requestFlags are the flags that build a job request; -f excludes them.
var requestFlags = []string{"name", "gpus", "model", "gpu-memory", "priority", "pool", "duration", "exit-code", "checkpoint"}

func (a *app) submitCmd(fs *flag.FlagSet) func(context.Context, []string, []string) int {
	var (
		file, id, name, model, priority, pool, duration string
		gpus, exitCode                                  int
		gpuMemory                                       int64
		watch, checkpoint                               bool
	)
	fs.StringVar(&file, "f", "", "read the JobRequest from a YAML or JSON file (- for stdin)")
	fs.StringVar(&id, "id", "", "job ID (default: a new time-ordered ID); also the submit's Nats-Msg-Id")
	fs.StringVar(&name, "name", "", "job name")
	fs.IntVar(&gpus, "gpus", 1, "number of whole GPUs, 1 to 64")
	fs.StringVar(&model, "model", contracts.GPUModelAny, fmt.Sprintf("GPU model: %s or one of %s", contracts.GPUModelAny, strings.Join(contracts.GPUModels, ", ")))
	fs.Int64Var(&gpuMemory, "gpu-memory", 0, "minimum memory per GPU in MiB")
	fs.StringVar(&priority, "priority", "", "critical, high, normal (default) or best-effort")
	fs.StringVar(&pool, "pool", "", "restrict placement to one node pool")
	fs.StringVar(&duration, "duration", "30s", "a simulated run's length; with a command after --, a time limit (only when given)")
	fs.IntVar(&exitCode, "exit-code", 0, "exit code the simulated run ends with")
	fs.BoolVar(&checkpoint, "checkpoint", false, "the job implements the checkpoint protocol (SIGUSR1, GPUPLANE_CHECKPOINT_DIR; see FLOWS.md)")
	fs.BoolVar(&watch, "watch", false, "then watch the job until it ends (exit code as for watch)")
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
		} else {
			doc = flagsRequest(name, gpus, model, gpuMemory, priority, pool, duration, set["duration"], exitCode, checkpoint, trailing)
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

// flagsRequest builds the request document from the submit flags. It is
// JSON, so that it goes through exactly the decoding a posted body does.
func flagsRequest(name string, gpus int, model string, gpuMemory int64, priority, pool, duration string, durationSet bool, exitCode int, checkpoint bool, command []string) []byte {
	gpu := map[string]any{"count": gpus}
	if model != "" {
		gpu["model"] = model
	}
	if gpuMemory != 0 {
		gpu["memoryMiB"] = gpuMemory
	}
	run := map[string]any{}
	if len(command) > 0 {
		run["command"] = command
	}
	if len(command) == 0 || durationSet {
		run["duration"] = duration
	}
	if checkpoint {
		run["checkpoint"] = true
	}
	if exitCode != 0 {
		run["exitCode"] = exitCode
	}
	doc := map[string]any{"resources": map[string]any{"gpu": gpu}, "run": run}
	for k, v := range map[string]string{"name": name, "priority": priority, "pool": pool} {
		if v != "" {
			doc[k] = v
		}
	}
	data, _ := json.Marshal(doc) // maps of strings, numbers and slices always encode
	return data
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
	ve, ok := errors.AsType[*contracts.ValidationError](err)
	if !ok {
		return err
	}
	return &apiError{Body: contracts.APIErrorBody{Reason: ve.Reason,
		Message: "invalid job request (checked before sending)", Fields: ve.Fields}}
}

// submit sends a validated request over the chosen transport.
func (a *app) submit(ctx context.Context, req contracts.JobRequest, doc []byte) (contracts.SubmitResponse, error) {
	if a.via == viaBus {
		return a.publish(ctx, contracts.SubjectSubmit(a.tenant), contracts.SubmitMsgID(a.tenant, req.ID), req.ID, doc, contracts.CEType(req))
	}
	var res contracts.SubmitResponse
	err := newClient(a.gateway).call(ctx, http.MethodPost, tenantPath(a.tenant, "jobs"), nil, doc, &res)
	return res, err
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
			var q url.Values
			if reason != "" {
				q = url.Values{"reason": {reason}}
			}
			err = newClient(a.gateway).call(ctx, http.MethodDelete, tenantPath(a.tenant, "jobs", id), q, nil, &res)
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

// connectBus connects for --via bus, without provisioning streams: the
// platform's services own them.
func (a *app) connectBus(ctx context.Context) (*bus.Bus, error) {
	b, err := bus.Connect(ctx, bus.Config{
		URL: a.nats, Name: "gpuctl", SkipProvision: true, ConnectTimeout: busTimeout,
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
