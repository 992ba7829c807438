package contracts

// CloudEvents NATS protocol binding (binary mode): the attributes travel as
// headers with the "ce-" prefix and the body is the event data. See
// https://github.com/cloudevents/spec/blob/main/cloudevents/bindings/nats-protocol-binding.md
const (
	HeaderCESpecVersion = "ce-specversion"
	HeaderCEType        = "ce-type"
	HeaderCESource      = "ce-source"
	HeaderCEID          = "ce-id"
	HeaderCETime        = "ce-time" // not sent by libs/bus: the stream's timestamp is the time
	HeaderCESubject     = "ce-subject"
	HeaderCEDataSchema  = "ce-dataschema"
	HeaderContentType   = "content-type" // not sent by libs/bus: every body is JSON
	// HeaderMsgID is JetStream's de-duplication header; always equal to ce-id.
	HeaderMsgID = "Nats-Msg-Id"

	CESpecVersion   = "1.0"
	ContentTypeJSON = "application/json"

	// HeaderDeadLetterReason, on a dead-lettered message, says why it was
	// given up on; the original subject and sequence come with it.
	HeaderDeadLetterReason   = "Gp-Dead-Letter-Reason"
	HeaderDeadLetterSubject  = "Gp-Original-Subject"
	HeaderDeadLetterSequence = "Gp-Original-Sequence"
	HeaderDeadLetterStream   = "Gp-Original-Stream"
)

// CETyper is implemented by messages whose CloudEvents type depends on
// their content.
type CETyper interface{ CEType() string }

// CEType returns the CloudEvents type of a message of this package.
func CEType(v any) string {
	switch m := v.(type) {
	case CETyper:
		return m.CEType()
	case *JobRequest, JobRequest:
		return "io.gpuplane.job.request.v1"
	case *CancelRequest, CancelRequest:
		return "io.gpuplane.job.cancel.v1"
	case *Plan, Plan:
		return "io.gpuplane.plan.v1"
	case *Refusal, Refusal:
		return "io.gpuplane.allocation.refused.v1"
	case *NodeCommand, NodeCommand:
		return "io.gpuplane.node.command.v1"
	case *NodeInventory, NodeInventory:
		return "io.gpuplane.node.inventory.v1"
	case *Heartbeat, Heartbeat:
		return "io.gpuplane.node.heartbeat.v1"
	case *Telemetry, Telemetry:
		return "io.gpuplane.node.telemetry.v1"
	case *NodeEvent, NodeEvent:
		return "io.gpuplane.node.lifecycle.v1"
	case *HealthEvent, HealthEvent:
		return "io.gpuplane.node.health.v1"
	case *PoolDemand, PoolDemand:
		return "io.gpuplane.pool.demand.v1"
	case *ScaleDecision, ScaleDecision:
		return "io.gpuplane.pool.scale.v1"
	case *Alert, Alert:
		return "io.gpuplane.alert.v1"
	case *UsageRecord, UsageRecord:
		return "io.gpuplane.usage.v1"
	}
	return "io.gpuplane.unknown.v1"
}
