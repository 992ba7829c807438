// Package contracts is the only thing gpuplane's services share about each
// other: every subject, every stream, every message schema and the job state
// machine. A service imports contracts and libs, never another service.
//
// # Job state machine
//
// A job's state is owned by the scheduler (single writer); every change is a
// JobEvent on gp.jobs.events.<tenant>.<job>. The allowed transitions are
// enforced by Transition and written here once:
//
//	(new)      --queued-->     Queued       request accepted, waiting for placement
//	(new)      --rejected-->   Rejected     request invalid (terminal, carries reasons)
//	Queued     --pending-->    Queued       the pending reason changed (no state change)
//	Queued     --scheduled-->  Scheduled    the resource manager committed an allocation
//	Queued     --cancelled-->  Cancelled    the user cancelled before placement
//	Queued     --failed-->     Failed       it can never run (e.g. a dependency failed)
//	Scheduled  --running-->    Running      the node agent started the run
//	Scheduled  --migrating-->  Scheduled    being moved off its devices (no state change)
//	Scheduled  --pulling-->    Scheduled    the node agent pulls the run's image (no state change)
//	Scheduled  --requeued-->   Queued       the allocation was lost before start (attempt+1)
//	Scheduled  --cancelled-->  Cancelled
//	Scheduled  --failed-->     Failed       the run could not be launched
//	Running    --succeeded-->  Succeeded    exit code 0
//	Running    --failed-->     Failed       non-zero exit code or lost run
//	Running    --cancelled-->  Cancelled    stopped on the user's request
//	Running    --requeued-->   Queued       preempted, migrated or node lost (attempt+1)
//	Running    --migrating-->  Running      being moved: checkpoint, stop, requeue follow
//	Running    --migrated-->   Running      a moved job's next attempt runs on its new devices
//
// Succeeded, Failed, Cancelled and Rejected are terminal: no event leaves them.
// Consumers that fold events into a read model apply Transition and ignore
// (but may log) an event it refuses; that is how a redelivered or stale
// event is made harmless.
//
// # Envelope
//
// Every message body is JSON with a schemaVersion field. Every message
// carries the CloudEvents NATS binding as headers (ce-specversion, ce-type,
// ce-source, ce-id, ce-subject; no ce-time, the stream's timestamp is the
// time, and no content-type, every body is JSON) and a Nats-Msg-Id
// equal to ce-id, which JetStream uses to drop duplicate publishes. Event IDs
// are derived from what happened (job, attempt, kind), never random, so a
// handler that runs twice publishes the same ID twice and the stream keeps one.
//
// # Tenancy
//
// The tenant is a subject token, never trusted from a body: a request whose
// body names another tenant than its subject is rejected with
// ReasonTenantMismatch. This lets NATS permissions isolate tenants.
package contracts
