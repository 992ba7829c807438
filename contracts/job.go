package contracts

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/invopop/jsonschema"
)

// SchemaVersion is the current version of every message schema in this
// package. A message with schemaVersion 0 (absent) is read as version 1.
const SchemaVersion = 1

// Priority classes, highest first. Within a class the queue is FIFO.
type Priority string

const (
	PriorityCritical   Priority = "critical"
	PriorityHigh       Priority = "high"
	PriorityNormal     Priority = "normal"
	PriorityBestEffort Priority = "best-effort"
)

// Priorities lists the classes from highest to lowest.
var Priorities = []Priority{PriorityCritical, PriorityHigh, PriorityNormal, PriorityBestEffort}

// Rank orders classes: a higher rank is served first. Unknown classes rank -1.
func (p Priority) Rank() int {
	switch p {
	case PriorityCritical:
		return 3
	case PriorityHigh:
		return 2
	case PriorityNormal, "":
		return 1
	case PriorityBestEffort:
		return 0
	}
	return -1
}

// GPUModelAny matches every GPU model.
const GPUModelAny = "any"

// GPUModels are the model identifiers a request may name. The node agent's
// catalogue gives each its real figures; this list is only the vocabulary
// that requests and inventories share.
var GPUModels = []string{
	"V100-16GB", "V100-32GB",
	"A100-40GB", "A100-80GB",
	"H100-80GB", "H100-80GB-PCIE",
	"H200-141GB",
	"L4", "T4", "L40S",
}

// KnownGPUModel reports whether m is a catalogued model identifier.
func KnownGPUModel(m string) bool { return slices.Contains(GPUModels, m) }

// Limits on a request; beyond them a request is rejected as out_of_range.
const (
	MaxGPUsPerJob   = 1024
	MaxGPUMemoryMiB = 1 << 20 // 1 TiB: larger than any card
	MaxJobDuration  = 30 * 24 * time.Hour
	MaxNameLength   = 256
	MaxCommandArgs  = 256
	MaxCommandBytes = 16 * 1024
	MaxEnvVars      = 128
	MaxEnvBytes     = 16 * 1024
	// MaxFieldErrors bounds the field errors one rejection lists, so a
	// hostile request cannot make its own rejection too large to publish.
	MaxFieldErrors    = 32
	MaxLabels         = 64
	MaxLabelBytes     = 256
	MaxCPUMilli       = 1024 * 1000
	MaxHostMemoryMiB  = 16 << 20
	MaxCancelReasonSz = 1024
)

// JobRequest is what a client publishes on SubjectSubmit(tenant) or POSTs to
// the gateway. ID is chosen by the client and is also the Nats-Msg-Id of the
// publish, so a retried submit is dropped by JetStream; the scheduler is
// idempotent on (tenant, id) beyond the duplicate window as well.
type JobRequest struct {
	SchemaVersion int               `json:"schemaVersion,omitempty" jsonschema:"enum=1"`
	ID            string            `json:"id" jsonschema:"pattern=^[A-Za-z0-9][A-Za-z0-9_-]{0\\,127}$"`
	Tenant        string            `json:"tenant,omitempty" jsonschema:"description=optional; must equal the tenant token of the subject"`
	Name          string            `json:"name,omitempty"`
	Priority      Priority          `json:"priority,omitempty" jsonschema:"enum=critical,enum=high,enum=normal,enum=best-effort"`
	Pool          string            `json:"pool,omitempty" jsonschema:"description=restrict placement to one node pool"`
	Resources     Resources         `json:"resources"`
	Run           RunSpec           `json:"run"`
	Labels        map[string]string `json:"labels,omitempty"`
	// NodeSelector restricts placement to nodes carrying every label.
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`
	// Tolerations let the job onto tainted nodes.
	Tolerations []Toleration `json:"tolerations,omitempty"`
	// DependsOn names jobs of the same tenant that must succeed first; the
	// job is cancelled (dependency_failed) when one fails or is cancelled.
	DependsOn []string `json:"dependsOn,omitempty"`
	// PlacementTimeout fails the job (placement_timeout) when it is not
	// placed in full this long after it was queued; 0 waits forever.
	PlacementTimeout Duration `json:"placementTimeout,omitempty"`
	// ExpectedRunTime is how long the job expects to run. Backfill uses it
	// (a simulated run's duration or a command's time limit when unset);
	// a job with none is never backfilled ahead of a reservation.
	ExpectedRunTime Duration `json:"expectedRunTime,omitempty"`
}

// Resources is what one job asks for: whole GPUs (on one machine, or
// split evenly over GPU.Nodes machines as a gang), one MIG instance, or a
// share of one GPU; and CPU and host memory per machine.
type Resources struct {
	GPU       GPURequest `json:"gpu"`
	CPUMilli  int64      `json:"cpuMilli,omitempty"`
	MemoryMiB int64      `json:"memoryMiB,omitempty"`
}

// GPURequest asks for Count whole GPUs of Model (or any model) with at least
// MemoryMiB of framebuffer each; or, with MIGProfile, one MIG instance of
// that profile; or, with Share, a fraction of one GPU.
type GPURequest struct {
	Count     int    `json:"count" jsonschema:"minimum=1,maximum=1024"`
	Model     string `json:"model,omitempty" jsonschema:"description=a GPU model identifier or 'any'"`
	MemoryMiB int64  `json:"memoryMiB,omitempty" jsonschema:"description=minimum framebuffer per GPU"`
	// Models lists the allowed models, instead of one Model.
	Models []string `json:"models,omitempty"`
	// MIGProfile asks for one existing MIG instance of this profile
	// ("1g.10gb"); Count must be 1.
	MIGProfile string `json:"migProfile,omitempty"`
	// Share asks for a fraction of one GPU (framebuffer and SM percent,
	// enforced with MPS); Count must be 1.
	Share *GPUShare `json:"share,omitempty"`
	// Nodes spreads Count whole GPUs evenly over this many machines,
	// placed all or nothing (a gang). 0 or 1: one machine.
	Nodes int `json:"nodes,omitempty" jsonschema:"minimum=0,maximum=128"`
	// Topology constrains a multi-GPU job: nvlink (each machine's GPUs in
	// one NVLink domain) or zone (all machines in one zone).
	Topology Topology `json:"topology,omitempty" jsonschema:"enum=,enum=nvlink,enum=zone"`
}

// RunSpec says what to run: a simulated run of Duration, a container image
// (Image, with Command and Args overriding its ENTRYPOINT and CMD as in
// Kubernetes), or a host command (Command with Args appended) where the
// pool allows host commands (PoolRuntime). A simulated run sets Duration
// alone; a container or a command may also set Duration as a time limit.
// runtime.go holds the container fields' rules.
type RunSpec struct {
	Duration Duration          `json:"duration,omitempty" jsonschema:"description=Go duration such as 30s; a simulated run's length or a command's time limit"`
	Command  []string          `json:"command,omitempty"`
	Env      map[string]string `json:"env,omitempty"`
	// Image is an OCI image reference, by tag or digest
	// ("ghcr.io/acme/train:v3", "busybox",
	// "registry.example:5000/x@sha256:..."); the run is a container.
	Image string `json:"image,omitempty" jsonschema:"description=OCI image reference (tag or digest); the run is a container of it"`
	// Args replace the image's CMD; without an image they follow Command.
	Args []string `json:"args,omitempty"`
	// WorkingDir is the container's working directory (default the
	// image's).
	WorkingDir string `json:"workingDir,omitempty"`
	// Mounts are host paths of the pool's mount roots the container sees.
	Mounts []Mount `json:"mounts,omitempty"`
	// ShmSizeMiB is the size of the container's /dev/shm (default
	// DefaultShmSizeMiB).
	ShmSizeMiB int64 `json:"shmSizeMiB,omitempty"`
	// User is who the container's process runs as: "uid[:gid]" or a
	// name[:group] of the image (default the image's user, and never
	// root by default).
	User string `json:"user,omitempty"`
	// ExitCode is the exit code a simulated run ends with (default 0).
	ExitCode int `json:"exitCode,omitempty"`
	// Checkpoint declares that the job implements the checkpoint protocol
	// (FLOWS.md, "Checkpoints"): it writes a checkpoint on SIGUSR1 and
	// restores from GPUPLANE_RESTORE_FROM. Only such jobs are ever sent
	// SIGUSR1 (it ends a process that does not handle it); the others are
	// restarted from the beginning when they must move.
	Checkpoint bool `json:"checkpoint,omitempty"`
}

// Duration is a time.Duration encoded as a Go duration string ("90s").
type Duration time.Duration

// MarshalJSON encodes d as a duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON accepts a duration string, or a number of seconds. (A
// request body is held to its schema first, which takes only the string;
// numbers stay readable for documents stored before that.) A value
// beyond what a Duration holds (about 292 years) is refused as such,
// never wrapped around to a negative one.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	// A quoted plain-ASCII duration ("30s"), the form every writer of ours
	// uses, is taken as it is: this method runs inside the decode of every
	// message that carries a duration, and a second decoder pass per field
	// showed in the burst profile. Anything else (escapes, control or
	// non-ASCII bytes, numbers) goes through encoding/json as before.
	if plain, ok := plainQuoted(b); ok {
		return d.parse(plain)
	}
	if err := json.Unmarshal(b, &s); err == nil {
		return d.parse(s)
	}
	var secs float64
	if err := json.Unmarshal(b, &secs); err != nil {
		if _, isNum := new(big.Float).SetString(string(bytes.TrimSpace(b))); isNum {
			return fmt.Errorf("%w: %s seconds is longer than the largest duration, %s", errDurationRange, b, time.Duration(math.MaxInt64))
		}
		return fmt.Errorf("%w: want a string such as \"30s\" or a number of seconds", errBadDuration)
	}
	// float64(MaxInt64) rounds up to 2^63, so >= refuses it too.
	if ns := secs * float64(time.Second); math.IsNaN(ns) || ns >= math.MaxInt64 || ns < math.MinInt64 {
		return fmt.Errorf("%w: %s seconds is beyond the largest duration, %s", errDurationRange, b, time.Duration(math.MaxInt64))
	}
	*d = Duration(secs * float64(time.Second))
	return nil
}

// parse sets d from the text of a JSON string.
func (d *Duration) parse(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		if isDurationText(s) { // durationPattern (match.go)
			return fmt.Errorf("%w: %q is longer than the largest duration, %s", errDurationRange, s, time.Duration(math.MaxInt64))
		}
		return fmt.Errorf("%w: %q is not a duration such as \"30s\"", errBadDuration, s)
	}
	*d = Duration(v)
	return nil
}

// plainQuoted returns the text of a JSON string made only of printable
// ASCII without escapes, which encoding/json would decode to the same
// text; ok is false for anything else.
func plainQuoted(b []byte) (string, bool) {
	n := len(b)
	if n < 2 || b[0] != '"' || b[n-1] != '"' {
		return "", false
	}
	for _, c := range b[1 : n-1] {
		if c < 0x20 || c > 0x7e || c == '"' || c == '\\' {
			return "", false
		}
	}
	return string(b[1 : n-1]), true
}

// JSONSchema describes Duration in the published schemas: a string only,
// in the form durationPattern says.
func (Duration) JSONSchema() *jsonschema.Schema {
	return &jsonschema.Schema{Type: "string", Pattern: durationPattern,
		Description: "a Go duration such as 30s, 1h30m or 0.5s: no sign, at least one unit"}
}

// D returns d as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

var errBadDuration = errors.New("invalid duration")

// errDurationRange is a duration too long for a Duration: out of range
// rather than malformed.
var errDurationRange = errors.New("duration out of range")

// DecodeJobRequest decodes and validates a job request received on
// SubjectSubmit(subjectTenant). It never panics; every problem comes back as
// a *ValidationError with machine-readable reasons.
func DecodeJobRequest(data []byte, subjectTenant string) (JobRequest, error) {
	var req JobRequest
	if err := decodeValidated(data, &req, func() error { return req.Validate(subjectTenant) }); err != nil {
		if req.ID == "" {
			// Not decoded: the ID alone, if there is one, so that the
			// rejection goes to the job's own subject.
			req.ID = topLevelID(data)
		}
		return req, durationFieldError(data, err)
	}
	// The queued event echoes the normalized request; escapes can make it
	// larger than the body was. Refuse here what could not be answered.
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // as the bus encodes
	if err := enc.Encode(req.Normalized(subjectTenant)); err != nil || buf.Len() > MaxMessageBytes {
		return req, newValidationError([]FieldError{{Reason: ReasonTooLarge,
			Message: fmt.Sprintf("the normalized request is %d bytes, limit is %d", buf.Len(), MaxMessageBytes)}})
	}
	return req, nil
}

// durationPaths are the JSON paths of a job request's Duration fields.
var durationPaths = [][]string{{"run", "duration"}, {"placementTimeout"}, {"expectedRunTime"}}

// durationFieldError names the duration a decoder rejected: encoding/json
// reports an Unmarshaler's error without its field (decodeFieldError
// assumes run.duration), so the request is read again to find the first
// duration that does not parse.
func durationFieldError(data []byte, err error) error {
	ve, ok := err.(*ValidationError)
	if !ok || len(ve.Fields) != 1 || ve.Fields[0].Field != "run.duration" ||
		(ve.Fields[0].Reason != ReasonInvalidDuration && ve.Fields[0].Reason != ReasonOutOfRange) {
		return err
	}
	for _, path := range durationPaths {
		raw := json.RawMessage(data)
		for _, key := range path {
			var obj map[string]json.RawMessage
			if json.Unmarshal(raw, &obj) != nil {
				raw = nil
				break
			}
			raw = obj[key]
		}
		var d Duration
		if raw != nil && d.UnmarshalJSON(raw) != nil {
			ve.Fields[0].Field = strings.Join(path, ".")
			return ve
		}
	}
	return err
}

func decodeFieldError(err error) FieldError {
	var typeErr *json.UnmarshalTypeError
	var syntaxErr *json.SyntaxError
	switch {
	case errors.As(err, &typeErr):
		return FieldError{Field: typeErr.Field, Reason: ReasonInvalidType,
			Message: fmt.Sprintf("got JSON %s, want %s", typeErr.Value, typeErr.Type)}
	case errors.As(err, &syntaxErr):
		return FieldError{Reason: ReasonInvalidJSON, Message: fmt.Sprintf("%v at byte %d", syntaxErr, syntaxErr.Offset)}
	case errors.Is(err, errDurationRange):
		return FieldError{Field: "run.duration", Reason: ReasonOutOfRange, Message: err.Error()}
	case errors.Is(err, errBadDuration):
		return FieldError{Field: "run.duration", Reason: ReasonInvalidDuration, Message: err.Error()}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return FieldError{Reason: ReasonInvalidJSON, Message: "unexpected end of JSON"}
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		name := strings.Trim(strings.TrimPrefix(err.Error(), "json: unknown field "), `"`)
		return FieldError{Field: name, Reason: ReasonUnknownField, Message: fmt.Sprintf("unknown field %q", name)}
	default:
		return FieldError{Reason: ReasonInvalidJSON, Message: err.Error()}
	}
}

// Validate checks the request against the tenant of the subject it came on.
// It reports every problem at once.
func (r *JobRequest) Validate(subjectTenant string) error {
	var errs []FieldError
	add := func(field string, reason Reason, format string, args ...any) {
		errs = append(errs, FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	if r.SchemaVersion != 0 && r.SchemaVersion != SchemaVersion {
		add("schemaVersion", ReasonUnsupportedSchema, "schema version %d is not supported; this server speaks %d", r.SchemaVersion, SchemaVersion)
	}
	if err := ValidateTenant(subjectTenant); err != nil {
		add("tenant", ReasonInvalidTenant, "%v", err)
	} else if r.Tenant != "" && r.Tenant != subjectTenant {
		add("tenant", ReasonTenantMismatch, "body names tenant %q but was submitted for tenant %q", r.Tenant, subjectTenant)
	}
	switch {
	case r.ID == "":
		add("id", ReasonMissingField, "id is required: a client-chosen job ID, also used as Nats-Msg-Id")
	case ValidateID(r.ID) != nil:
		add("id", ReasonInvalidID, "%v", ValidateID(r.ID))
	}
	// Characters, as the schema's maxLength counts them.
	if n := utf8.RuneCountInString(r.Name); n > MaxNameLength {
		add("name", ReasonOutOfRange, "name is %d characters, limit is %d", n, MaxNameLength)
	}
	if r.Priority.Rank() < 0 {
		add("priority", ReasonUnknownPriority, "unknown priority %q; want one of %v", r.Priority, Priorities)
	}
	if r.Pool != "" {
		if err := ValidatePool(r.Pool); err != nil {
			add("pool", ReasonInvalidValue, "%v", err)
		}
	}
	g := r.Resources.GPU
	switch {
	case g.Count < 1:
		add("resources.gpu.count", ReasonOutOfRange, "gpu count is %d; want 1 to %d", g.Count, MaxGPUsPerJob)
	case g.Count > MaxGPUsPerJob:
		add("resources.gpu.count", ReasonOutOfRange, "gpu count is %d; want 1 to %d", g.Count, MaxGPUsPerJob)
	}
	if g.Model != "" && g.Model != GPUModelAny && !KnownGPUModel(g.Model) {
		add("resources.gpu.model", ReasonUnknownGPUModel, "unknown GPU model %q; want %q or one of %v", g.Model, GPUModelAny, GPUModels)
	}
	if g.MemoryMiB < 0 || g.MemoryMiB > MaxGPUMemoryMiB {
		add("resources.gpu.memoryMiB", ReasonOutOfRange, "gpu memory is %d MiB; want 0 to %d", g.MemoryMiB, MaxGPUMemoryMiB)
	}
	if r.Resources.CPUMilli < 0 || r.Resources.CPUMilli > MaxCPUMilli {
		add("resources.cpuMilli", ReasonOutOfRange, "cpu is %d milli-CPU; want 0 to %d", r.Resources.CPUMilli, MaxCPUMilli)
	}
	if r.Resources.MemoryMiB < 0 || r.Resources.MemoryMiB > MaxHostMemoryMiB {
		add("resources.memoryMiB", ReasonOutOfRange, "host memory is %d MiB; want 0 to %d", r.Resources.MemoryMiB, MaxHostMemoryMiB)
	}
	run := r.Run
	switch {
	case run.Duration < 0:
		add("run.duration", ReasonInvalidDuration, "duration %s is negative", run.Duration.D())
	case run.Duration.D() > MaxJobDuration:
		add("run.duration", ReasonOutOfRange, "duration %s exceeds the limit of %s", run.Duration.D(), MaxJobDuration)
	}
	if len(run.Command) == 0 && run.Duration == 0 && run.Image == "" {
		add("run", ReasonMissingField, "set run.duration for a simulated run, run.image for a container or run.command for a host command")
	}
	// Command and args are one argv, bounded together.
	if n := len(run.Command) + len(run.Args); n > MaxCommandArgs {
		add("run.command", ReasonOutOfRange, "command and args have %d arguments, limit is %d", n, MaxCommandArgs)
	} else if n > 0 {
		size := 0
		for _, a := range run.Argv() {
			size += len(a)
		}
		if len(run.Command) > 0 && run.Command[0] == "" {
			add("run.command", ReasonInvalidValue, "command[0] (the program) is empty")
		}
		if size > MaxCommandBytes {
			add("run.command", ReasonOutOfRange, "command and args are %d bytes, limit is %d", size, MaxCommandBytes)
		}
	}
	if len(run.Command) == 0 && run.Image == "" && len(run.Env) > 0 {
		add("run.env", ReasonConflictingRun, "env is only meaningful with a command or an image")
	}
	run.validateContainer(r.Resources.MemoryMiB, add)
	if len(run.Env) > MaxEnvVars {
		add("run.env", ReasonOutOfRange, "env has %d variables, limit is %d", len(run.Env), MaxEnvVars)
	}
	envBytes := 0
	for k, v := range run.Env {
		envBytes += len(k) + len(v)
		if k == "" || strings.ContainsAny(k, "=\x00") {
			add("run.env", ReasonInvalidValue, "env name %q is not a valid variable name", k)
		}
	}
	if envBytes > MaxEnvBytes {
		add("run.env", ReasonOutOfRange, "env is %d bytes, limit is %d", envBytes, MaxEnvBytes)
	}
	if run.ExitCode < 0 || run.ExitCode > 255 {
		add("run.exitCode", ReasonOutOfRange, "exit code %d; want 0 to 255", run.ExitCode)
	}
	r.validateScheduling(add)
	if len(r.Labels) > MaxLabels {
		add("labels", ReasonOutOfRange, "%d labels, limit is %d", len(r.Labels), MaxLabels)
	}
	for k, v := range r.Labels {
		if k == "" || len(k)+len(v) > MaxLabelBytes {
			add("labels", ReasonInvalidValue, "label %q is empty or longer than %d bytes", k, MaxLabelBytes)
		}
	}
	// Sorted by field and message: errors from map keys would otherwise
	// come in random order, and a redelivered request must be answered
	// with the same rejection.
	slices.SortFunc(errs, func(a, b FieldError) int {
		if c := strings.Compare(a.Field, b.Field); c != 0 {
			return c
		}
		return strings.Compare(a.Message, b.Message)
	})
	if len(errs) > MaxFieldErrors {
		more := len(errs) - MaxFieldErrors + 1
		errs = append(errs[:MaxFieldErrors-1], FieldError{Reason: errs[MaxFieldErrors-1].Reason,
			Message: fmt.Sprintf("and %d more problems", more)})
	}
	return newValidationError(errs)
}

// Normalized returns a copy with defaults filled in: schema version,
// tenant, priority and model. The scheduler stores and publishes the
// normalized form.
func (r JobRequest) Normalized(tenant string) JobRequest {
	r.SchemaVersion = SchemaVersion
	r.Tenant = tenant
	if r.Priority == "" {
		r.Priority = PriorityNormal
	}
	if r.Resources.GPU.Model == "" {
		r.Resources.GPU.Model = GPUModelAny
	}
	return r
}

// SubmitMsgID is the Nats-Msg-Id for a job request: unique per tenant and
// job ID, so a retried submit is dropped inside the duplicate window.
func SubmitMsgID(tenant, jobID string) string { return "submit/" + tenant + "/" + jobID }

// CancelRequest asks to cancel a job; published on SubjectCancel(tenant).
type CancelRequest struct {
	SchemaVersion int    `json:"schemaVersion,omitempty"`
	JobID         string `json:"jobId"`
	Reason        string `json:"reason,omitempty"`
}

// DecodeCancelRequest decodes and validates a cancel request.
func DecodeCancelRequest(data []byte) (CancelRequest, error) {
	var c CancelRequest
	err := decodeValidated(data, &c, func() error { return c.validate() })
	return c, err
}

func (c CancelRequest) validate() error {
	var errs []FieldError
	if c.SchemaVersion != 0 && c.SchemaVersion != SchemaVersion {
		errs = append(errs, FieldError{Field: "schemaVersion", Reason: ReasonUnsupportedSchema, Message: fmt.Sprintf("schema version %d is not supported", c.SchemaVersion)})
	}
	if err := ValidateID(c.JobID); err != nil {
		errs = append(errs, FieldError{Field: "jobId", Reason: ReasonInvalidID, Message: err.Error()})
	}
	if utf8.RuneCountInString(c.Reason) > MaxCancelReasonSz {
		errs = append(errs, FieldError{Field: "reason", Reason: ReasonOutOfRange, Message: "reason is too long"})
	}
	return newValidationError(errs)
}

// CancelMsgID is the Nats-Msg-Id of a cancel request.
func CancelMsgID(tenant, jobID string) string { return "cancel/" + tenant + "/" + jobID }

// RejectedJobID is the job ID under which a request whose own ID is missing
// or invalid is rejected: its stream sequence, so the rejection still has a
// subject (gp.jobs.events.<tenant>.rej-<seq>) that the submitter can watch.
func RejectedJobID(streamSeq uint64) string { return "rej-" + strconv.FormatUint(streamSeq, 10) }
