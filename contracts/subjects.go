package contracts

import (
	"fmt"
	"strings"
)

// Subjects come in pairs: a template to publish (a function taking the
// variable tokens) and a wildcard to subscribe. All live under the "gp" root
// so one NATS permission can fence the whole platform.
const (
	// SubjectSubmitAll matches job requests of every tenant: gp.jobs.submit.<tenant>.
	SubjectSubmitAll = "gp.jobs.submit.*"
	// SubjectCancelAll matches cancel requests of every tenant: gp.jobs.cancel.<tenant>.
	SubjectCancelAll = "gp.jobs.cancel.*"
	// SubjectJobEventsAll matches every job lifecycle event: gp.jobs.events.<tenant>.<job>.
	SubjectJobEventsAll = "gp.jobs.events.>"

	// SubjectPlansAll matches placement plans from schedulers to the resource manager.
	SubjectPlansAll = "gp.plans.>"

	// SubjectLedgerAll matches allocation ledger entries: gp.alloc.ledger.<node>.
	// The per-node subject is the unit of compare-and-set: a commit is
	// published with Nats-Expected-Last-Subject-Sequence.
	SubjectLedgerAll = "gp.alloc.ledger.*"
	// SubjectRefusedAll matches refused plan items: gp.alloc.refused.<tenant>.
	SubjectRefusedAll = "gp.alloc.refused.*"
	// SubjectAllocAll matches both ledger entries and refusals.
	SubjectAllocAll = "gp.alloc.>"

	// SubjectRunsAll matches run facts from node agents: gp.runs.<node>.
	SubjectRunsAll = "gp.runs.*"

	// SubjectInventoryAll matches node inventories: gp.nodes.inventory.<node>.
	SubjectInventoryAll = "gp.nodes.inventory.*"
	// SubjectNodeLifecycleAll matches node lifecycle events: gp.nodes.lifecycle.<node>.
	SubjectNodeLifecycleAll = "gp.nodes.lifecycle.*"
	// SubjectNodeHealthAll matches GPU health events: gp.nodes.health.<node>.
	SubjectNodeHealthAll = "gp.nodes.health.*"
	// SubjectNodesAll matches every node subject.
	SubjectNodesAll = "gp.nodes.>"

	// SubjectHeartbeatAll matches agent heartbeats: gp.heartbeat.<node>.
	SubjectHeartbeatAll = "gp.heartbeat.*"
	// SubjectTelemetryAll matches per-machine telemetry batches: gp.telemetry.<node>.
	SubjectTelemetryAll = "gp.telemetry.*"

	// SubjectNodeCommandsAll matches commands to node agents: gp.cmd.node.<node>.
	SubjectNodeCommandsAll = "gp.cmd.node.*"

	// SubjectDemandAll matches pending demand per pool: gp.sched.demand.<pool>.
	SubjectDemandAll = "gp.sched.demand.*"
	// SubjectScaleAll matches autoscaler decisions: gp.autoscale.decisions.<pool>.
	SubjectScaleAll = "gp.autoscale.decisions.*"
	// SubjectMachinesAll matches autoscaler machine events: gp.autoscale.machines.<pool>.
	SubjectMachinesAll = "gp.autoscale.machines.*"
	// SubjectAlertsAll matches alerts: gp.alerts.<kind>.
	SubjectAlertsAll = "gp.alerts.*"

	// SubjectUsageAll matches usage records: gp.usage.<tenant>.
	SubjectUsageAll = "gp.usage.*"

	// SubjectLogsAll matches run output: gp.logs.<tenant>.<job>.<node>.
	SubjectLogsAll = "gp.logs.>"

	// SubjectDeadLetterAll matches messages a consumer gave up on: gp.dlq.<stream>.<consumer>.
	SubjectDeadLetterAll = "gp.dlq.>"
)

// SubjectSubmit is where a tenant's job requests are published.
func SubjectSubmit(tenant string) string { return "gp.jobs.submit." + tenant }

// SubjectCancel is where a tenant's cancel requests are published.
func SubjectCancel(tenant string) string { return "gp.jobs.cancel." + tenant }

// SubjectJobEvents is where one job's lifecycle events are published.
func SubjectJobEvents(tenant, jobID string) string {
	return "gp.jobs.events." + tenant + "." + jobID
}

// SubjectTenantJobEvents matches every job event of one tenant.
func SubjectTenantJobEvents(tenant string) string { return "gp.jobs.events." + tenant + ".*" }

// SubjectPlan is where a scheduler publishes a plan.
func SubjectPlan(scheduler string) string { return "gp.plans." + scheduler }

// SubjectLedger is the per-node ledger subject.
func SubjectLedger(nodeID string) string { return "gp.alloc.ledger." + nodeID }

// SubjectRefused is where refused plan items of a tenant are published.
func SubjectRefused(tenant string) string { return "gp.alloc.refused." + tenant }

// SubjectRuns is where a node agent publishes run facts.
func SubjectRuns(nodeID string) string { return "gp.runs." + nodeID }

// NodeOfRunsSubject is the node whose run facts subject (SubjectRuns) this
// is; an error for any other subject.
func NodeOfRunsSubject(subject string) (string, error) {
	node, ok := strings.CutPrefix(subject, "gp.runs.")
	if !ok || node == "" || strings.ContainsAny(node, ".*> ") {
		return "", fmt.Errorf("subject %q is not a node's run facts subject", subject)
	}
	return node, nil
}

// SubjectInventory is where a node agent publishes its inventory.
func SubjectInventory(nodeID string) string { return "gp.nodes.inventory." + nodeID }

// SubjectNodeLifecycle is where the resource manager publishes node lifecycle events.
func SubjectNodeLifecycle(nodeID string) string { return "gp.nodes.lifecycle." + nodeID }

// SubjectNodeHealth is where a node agent publishes GPU health events.
func SubjectNodeHealth(nodeID string) string { return "gp.nodes.health." + nodeID }

// SubjectHeartbeat is where a node agent publishes heartbeats.
func SubjectHeartbeat(nodeID string) string { return "gp.heartbeat." + nodeID }

// SubjectTelemetry is where a node agent publishes a telemetry batch.
func SubjectTelemetry(nodeID string) string { return "gp.telemetry." + nodeID }

// SubjectNodeCommands is where commands for one node agent are published.
func SubjectNodeCommands(nodeID string) string { return "gp.cmd.node." + nodeID }

// SubjectDemand is where the scheduler publishes a pool's pending demand.
func SubjectDemand(pool string) string { return "gp.sched.demand." + pool }

// SubjectScale is where the autoscaler publishes a pool's scale decision.
func SubjectScale(pool string) string { return "gp.autoscale.decisions." + pool }

// SubjectMachines is where the autoscaler publishes its machine events.
func SubjectMachines(pool string) string { return "gp.autoscale.machines." + pool }

// SubjectAlert is where alerts of kind are published.
func SubjectAlert(kind string) string { return "gp.alerts." + kind }

// SubjectUsage is where billing publishes a tenant's usage records.
func SubjectUsage(tenant string) string { return "gp.usage." + tenant }

// SubjectLogs is where the node agent of node publishes the output of a
// job's runs there. The node is the last token so that a node agent's
// permissions can name its own output only (contracts.Access).
func SubjectLogs(tenant, jobID, node string) string {
	return "gp.logs." + tenant + "." + jobID + "." + node
}

// SubjectJobLogs matches the output of every run of a job, on any node.
func SubjectJobLogs(tenant, jobID string) string { return "gp.logs." + tenant + "." + jobID + ".*" }

// SubjectDeadLetter is where a consumer parks a message it gave up on.
func SubjectDeadLetter(stream, consumer string) string {
	return "gp.dlq." + stream + "." + consumer
}

// Token returns the n-th dot-separated token of subject (0-based), or ""
// when the subject has fewer tokens.
func Token(subject string, n int) string {
	parts := strings.Split(subject, ".")
	if n < 0 || n >= len(parts) {
		return ""
	}
	return parts[n]
}

// TenantFromSubject extracts the tenant token from a submit, cancel, event,
// refused or usage subject.
func TenantFromSubject(subject string) (string, error) {
	var tok string
	switch {
	case strings.HasPrefix(subject, "gp.jobs."):
		tok = Token(subject, 3)
	case strings.HasPrefix(subject, "gp.alloc.refused."), strings.HasPrefix(subject, "gp.usage."):
		parts := strings.Split(subject, ".")
		tok = parts[len(parts)-1]
	}
	if err := ValidateTenant(tok); err != nil {
		return "", fmt.Errorf("subject %q: %w", subject, err)
	}
	return tok, nil
}

// ValidateTenant reports whether s can be a tenant: lowercase letters,
// digits and inner dashes, at most 32 characters. Tenants are subject tokens,
// so '.', '*', '>' and whitespace are never allowed.
func ValidateTenant(s string) error {
	if !isTenant(s) { // tenantPattern (match.go)
		return fmt.Errorf("invalid tenant %q: want 1-32 of [a-z0-9-], not starting or ending with '-'", s)
	}
	return nil
}

// ValidateID reports whether s can be a job, node or request ID: letters,
// digits, '_' and '-', 1-128 characters, starting with a letter or digit.
func ValidateID(s string) error {
	if !isID(s) { // idPattern (match.go)
		return fmt.Errorf("invalid id %q: want 1-128 of [A-Za-z0-9_-], starting with a letter or digit", s)
	}
	return nil
}

// ValidatePool reports whether s can be a pool name.
func ValidatePool(s string) error {
	if !isPool(s) { // poolPattern (match.go)
		return fmt.Errorf("invalid pool %q: want 1-48 of [a-z0-9-]", s)
	}
	return nil
}
