package contracts

import (
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Stream names. Streams under "log of record" keep what the platform must
// never lose (jobs, allocations, runs, usage); the others are high-volume or
// derived and age out. Of those, the evidence streams (jobs, allocations,
// usage, audit: who asked for what, who held which GPU, what was billed,
// who did what) also refuse a purge, and no code of the platform purges
// them; a server refuses to turn DenyPurge or DenyDelete off again.
const (
	StreamJobs         = "JOBS"          // job requests and cancels (log of record)
	StreamJobEvents    = "JOB_EVENTS"    // job lifecycle events (log of record)
	StreamPlans        = "PLANS"         // placement plans (commands, short-lived)
	StreamAllocations  = "ALLOCATIONS"   // the ledger and refusals (log of record)
	StreamRuns         = "RUNS"          // run facts from node agents (log of record)
	StreamNodes        = "NODES"         // inventory, lifecycle and health
	StreamHeartbeats   = "HEARTBEATS"    // liveness, last few per node
	StreamTelemetry    = "TELEMETRY"     // 1 s samples, short max age
	StreamNodeCommands = "NODE_COMMANDS" // commands for node agents
	StreamOps          = "OPS"           // demand, scale decisions, alerts
	StreamUsage        = "USAGE"         // usage records (log of record)
	StreamDeadLetters  = "DEAD_LETTERS"  // messages consumers gave up on
	StreamLogs         = "LOGS"          // run output, per tenant and job
	StreamAudit        = "AUDIT"         // the audit trail, hash-chained (evidence)
)

// DuplicateWindow is how long JetStream remembers a Nats-Msg-Id. Handlers
// must still be idempotent on their own keys: a redelivery can come later.
const DuplicateWindow = 2 * time.Minute

// SampleDuplicateWindow is the shorter window of HEARTBEATS and TELEMETRY.
// JetStream keeps every message ID of a stream for its window, and an
// agent sends a heartbeat every 2 s and a telemetry batch every second:
// at 10,000 machines two minutes of their IDs are 1.8 million entries, at
// about 170 bytes each in the NATS server's heap (its profile in
// BenchmarkScale) some 300 MB (issue 17). An agent retries a
// heartbeat within its interval, a telemetry batch within seconds; one
// stored twice after the window is one more sign of life or sample.
const SampleDuplicateWindow = 30 * time.Second

// MaxMessageBytes bounds every message body a service accepts. Larger
// bodies are rejected with ReasonTooLarge before decoding.
const MaxMessageBytes = 64 * 1024

// StreamOptions are the deployment-dependent knobs of the stream layout.
type StreamOptions struct {
	// Replicas is 1 for the embedded server and 3 in production.
	Replicas int
	// Storage is file storage unless Memory is set (tests that need speed).
	Memory bool
	// TelemetryMaxAge bounds how long telemetry is kept (default 10 minutes).
	TelemetryMaxAge time.Duration
	// LogsMaxBytes bounds the LOGS stream; the oldest output goes first
	// (default 1 GiB).
	LogsMaxBytes int64
	// OpsMaxBytes bounds the OPS stream; the oldest event goes first
	// (default 1 GiB). Its age bound alone let it grow with the fleet:
	// 376 MB in 14 minutes at 10,000 machines (issue 17). What reads it
	// back needs only recent history: the autoscaler each pool's last
	// decision and its machines' events (locate falls back to the node's
	// inventory), the monitor its open alert episodes.
	OpsMaxBytes int64
}

// PlansMaxAge is how long PLANS keeps a plan. The resource manager
// refuses to commit an item of an older plan (RefusedPlanExpired), and so
// needs to remember an ended allocation only about that long: a late
// commit of it can only come from a plan older than its end.
const PlansMaxAge = 24 * time.Hour

// MaxConsumersPerStream bounds the consumers of each stream: room for
// 2 x 10,000 standalone node agents and every service's replicas.
const MaxConsumersPerStream = 32768

// sized bounds an aging stream by bytes too; DiscardOld makes room.
func sized(c jetstream.StreamConfig, maxBytes int64) jetstream.StreamConfig {
	c.MaxBytes = maxBytes
	return c
}

// Streams returns the configuration of every stream of the platform. It is
// applied idempotently (create or update) by every service at start-up, so
// any service can come up first.
func Streams(o StreamOptions) []jetstream.StreamConfig {
	if o.Replicas <= 0 {
		o.Replicas = 1
	}
	if o.TelemetryMaxAge <= 0 {
		o.TelemetryMaxAge = 10 * time.Minute
	}
	if o.LogsMaxBytes <= 0 {
		o.LogsMaxBytes = 1 << 30
	}
	if o.OpsMaxBytes <= 0 {
		o.OpsMaxBytes = 1 << 30
	}
	storage := jetstream.FileStorage
	if o.Memory {
		storage = jetstream.MemoryStorage
	}
	record := func(name, desc string, subjects ...string) jetstream.StreamConfig {
		return jetstream.StreamConfig{
			Name:        name,
			Description: desc,
			Subjects:    subjects,
			Retention:   jetstream.LimitsPolicy,
			// DiscardNew: an overflowing stream refuses the publish, so the
			// publisher sees an error instead of an older record vanishing.
			Discard:           jetstream.DiscardNew,
			MaxBytes:          -1,
			MaxMsgs:           -1,
			Storage:           storage,
			Replicas:          o.Replicas,
			Duplicates:        DuplicateWindow,
			MaxMsgSize:        MaxMessageBytes * 2,
			AllowDirect:       true,
			AllowRollup:       false,
			DenyDelete:        true,
			DenyPurge:         false,
			MaxMsgsPerSubject: -1,
			// One standalone agent per machine holds a durable consumer on
			// ALLOCATIONS and NODE_COMMANDS and replays RUNS at start; the
			// server's default of 1,000 consumers per stream would stop a
			// fleet of more than 1,000 machines.
			MaxConsumers: MaxConsumersPerStream,
		}
	}
	aging := func(name, desc string, maxAge time.Duration, perSubject int64, subjects ...string) jetstream.StreamConfig {
		c := record(name, desc, subjects...)
		c.Discard = jetstream.DiscardOld
		c.MaxAge = maxAge
		c.MaxMsgsPerSubject = perSubject
		c.DenyDelete = false
		return c
	}
	evidence := func(c jetstream.StreamConfig) jetstream.StreamConfig {
		c.DenyPurge = true
		return c
	}
	samples := func(c jetstream.StreamConfig) jetstream.StreamConfig {
		c.Duplicates = SampleDuplicateWindow
		return c
	}
	return []jetstream.StreamConfig{
		evidence(record(StreamJobs, "job requests and cancel requests, per tenant", SubjectSubmitAll, SubjectCancelAll)),
		record(StreamJobEvents, "job lifecycle events, per tenant and job", SubjectJobEventsAll),
		aging(StreamPlans, "placement plans from schedulers", PlansMaxAge, -1, SubjectPlansAll),
		evidence(record(StreamAllocations, "allocation ledger (per-node CAS) and refused plan items", SubjectAllocAll)),
		record(StreamRuns, "run facts reported by node agents", SubjectRunsAll),
		aging(StreamNodes, "node inventory, lifecycle and GPU health", 7*24*time.Hour, 1000, SubjectNodesAll),
		samples(aging(StreamHeartbeats, "node agent heartbeats, the last few per node", time.Hour, 3, SubjectHeartbeatAll)),
		samples(aging(StreamTelemetry, "per-machine GPU telemetry batches, 1 s", o.TelemetryMaxAge, -1, SubjectTelemetryAll)),
		aging(StreamNodeCommands, "commands for node agents", 7*24*time.Hour, -1, SubjectNodeCommandsAll),
		sized(aging(StreamOps, "pending demand, scale decisions, machine events and alerts", 7*24*time.Hour, -1, SubjectDemandAll, SubjectScaleAll, SubjectMachinesAll, SubjectAlertsAll), o.OpsMaxBytes),
		evidence(record(StreamUsage, "metered usage records, per tenant", SubjectUsageAll)),
		aging(StreamDeadLetters, "messages a consumer gave up on, for inspection", 30*24*time.Hour, -1, SubjectDeadLetterAll),
		sized(aging(StreamLogs, "run output chunks, per tenant and job", 7*24*time.Hour, -1, SubjectLogsAll), o.LogsMaxBytes),
		evidence(record(StreamAudit, "audit trail: one hash-chained record per operation, denial and login", SubjectAuditAll)),
	}
}
