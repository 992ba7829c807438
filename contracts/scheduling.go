package contracts

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// This file holds what placement, quotas, pools and preemption share: the
// scheduling parts of a request, node taints, and the administrators' KV
// buckets the scheduler (and the resource manager) watch.

// Topology is a gang's placement constraint.
type Topology string

const (
	// TopologyAny puts no constraint beyond the machines asked for.
	TopologyAny Topology = ""
	// TopologyNVLink asks that each machine's GPUs of the job share one
	// NVLink domain (NVSwitch or bridged group).
	TopologyNVLink Topology = "nvlink"
	// TopologyZone asks that every machine of the job be in one zone.
	TopologyZone Topology = "zone"
)

// Topologies lists the valid constraints, for validation and docs.
var Topologies = []Topology{TopologyAny, TopologyNVLink, TopologyZone}

// TaintEffect says what a taint does to jobs that do not tolerate it.
type TaintEffect string

const (
	// TaintNoSchedule keeps jobs that do not tolerate it off the node.
	TaintNoSchedule TaintEffect = "NoSchedule"
	// TaintPreferNoSchedule lets such jobs on only when no other node fits.
	TaintPreferNoSchedule TaintEffect = "PreferNoSchedule"
)

// Taint marks a node so only jobs that tolerate it are placed there, as in
// Kubernetes: dedicated machines, spot capacity, hardware under test.
type Taint struct {
	Key    string      `json:"key"`
	Value  string      `json:"value,omitempty"`
	Effect TaintEffect `json:"effect"`
}

// TolerationOperator is Equal (key and value match) or Exists (key matches).
type TolerationOperator string

const (
	TolerationEqual  TolerationOperator = "Equal"
	TolerationExists TolerationOperator = "Exists"
)

// Toleration lets a job onto nodes with a matching taint. An empty Effect
// tolerates every effect; an empty Key with Exists tolerates every taint.
type Toleration struct {
	Key      string             `json:"key,omitempty"`
	Operator TolerationOperator `json:"operator,omitempty" jsonschema:"enum=Equal,enum=Exists"`
	Value    string             `json:"value,omitempty"`
	Effect   TaintEffect        `json:"effect,omitempty"`
}

// Tolerates reports whether t tolerates taint.
func (t Toleration) Tolerates(taint Taint) bool {
	if t.Effect != "" && t.Effect != taint.Effect {
		return false
	}
	if t.Key == "" {
		return t.Operator == TolerationExists
	}
	if t.Key != taint.Key {
		return false
	}
	if t.Operator == TolerationExists {
		return true
	}
	return t.Value == taint.Value
}

// Tolerated reports whether tolerations tolerate every taint of effect
// among taints.
func Tolerated(tolerations []Toleration, taints []Taint, effect TaintEffect) bool {
	for _, taint := range taints {
		if taint.Effect != effect {
			continue
		}
		if !slices.ContainsFunc(tolerations, func(t Toleration) bool { return t.Tolerates(taint) }) {
			return false
		}
	}
	return true
}

// Selected reports whether labels carry every key=value of selector.
func Selected(selector, labels map[string]string) bool {
	for k, v := range selector {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// PlacementPolicy chooses among the nodes a request fits.
type PlacementPolicy string

const (
	// PolicyBinpack fills the fullest node that fits first.
	PolicyBinpack PlacementPolicy = "binpack"
	// PolicySpread puts work on the emptiest node first.
	PolicySpread PlacementPolicy = "spread"
	// PolicyTopology prefers the node (and GPUs) with the tightest
	// interconnect for multi-GPU work, binpacking otherwise.
	PolicyTopology PlacementPolicy = "topology"
	// PolicyFragAware minimises the capacity the placement strands for
	// the workload the pool actually sees (ours; see fragsim).
	PolicyFragAware PlacementPolicy = "fragaware"
)

// PlacementPolicies lists the policies, for validation and docs.
var PlacementPolicies = []PlacementPolicy{PolicyBinpack, PolicySpread, PolicyTopology, PolicyFragAware}

// Valid reports whether p names a policy.
func (p PlacementPolicy) Valid() bool { return slices.Contains(PlacementPolicies, p) }

// KV buckets of scheduling administration.
const (
	// BucketQuotas holds one TenantQuota per tenant; the key is the tenant.
	// Changes apply at the scheduler's next cycle.
	BucketQuotas = "gp-quotas"
	// BucketPools holds one PoolConfig per pool; the key is the pool.
	BucketPools = "gp-pools"
	// BucketNodeAdmin holds one NodeAdmin per node an administrator
	// cordoned or drained; the key is the node ID.
	BucketNodeAdmin = "gp-node-admin"
)

// QuotaAllPools is the PoolQuota key that applies to every pool without
// its own entry.
const QuotaAllPools = "*"

// TenantQuota is a tenant's share of the cluster, stored in BucketQuotas.
// Usage is counted in GPUs as GPURequest.MilliGPUs counts it: a whole GPU
// is 1, a MIG instance its compute slices over 7, a share its compute
// percent over 100.
type TenantQuota struct {
	SchemaVersion int    `json:"schemaVersion,omitempty"`
	Tenant        string `json:"tenant"`
	// Weight is the tenant's weight in dominant-resource fair share
	// (default 1): a tenant of weight 2 is served as if it used half.
	Weight float64 `json:"weight,omitempty"`
	// StrictFIFO makes the tenant's queue strict: a job that cannot be
	// placed holds back every later job of the tenant in its class, even
	// ones that would fit.
	StrictFIFO bool `json:"strictFifo,omitempty"`
	// Pools maps a pool (or QuotaAllPools) to the tenant's quota there.
	Pools     map[string]PoolQuota `json:"pools,omitempty"`
	UpdatedAt time.Time            `json:"updatedAt,omitzero"`
}

// PoolQuota is a tenant's quota in one pool, in GPUs.
type PoolQuota struct {
	// Guarantee is what the tenant gets whenever it asks, reclaiming it by
	// preemption from tenants borrowing beyond theirs.
	Guarantee float64 `json:"guarantee"`
	// Max bounds what the tenant may hold, borrowed idle capacity
	// included; nil means no bound beyond the pool.
	Max *float64 `json:"max,omitempty"`
}

// For returns the quota that applies in pool, and whether one does.
func (q TenantQuota) For(pool string) (PoolQuota, bool) {
	if pq, ok := q.Pools[pool]; ok {
		return pq, true
	}
	pq, ok := q.Pools[QuotaAllPools]
	return pq, ok
}

// EffectiveWeight is Weight, or 1 when unset.
func (q TenantQuota) EffectiveWeight() float64 {
	if q.Weight <= 0 {
		return 1
	}
	return q.Weight
}

// Validate checks a quota stored for tenant.
func (q TenantQuota) Validate(tenant string) error {
	var errs []FieldError
	add := func(field string, reason Reason, format string, args ...any) {
		errs = append(errs, FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	if err := ValidateTenant(tenant); err != nil {
		add("tenant", ReasonInvalidTenant, "%v", err)
	} else if q.Tenant != "" && q.Tenant != tenant {
		add("tenant", ReasonTenantMismatch, "quota names tenant %q but is stored for %q", q.Tenant, tenant)
	}
	if q.Weight < 0 || q.Weight > 1000 {
		add("weight", ReasonOutOfRange, "weight %g; want 0 (default 1) to 1000", q.Weight)
	}
	pools := make([]string, 0, len(q.Pools))
	for p := range q.Pools {
		pools = append(pools, p)
	}
	slices.Sort(pools)
	for _, p := range pools {
		pq := q.Pools[p]
		field := "pools." + p
		if p != QuotaAllPools {
			if err := ValidatePool(p); err != nil {
				add(field, ReasonInvalidValue, "%v", err)
			}
		}
		if pq.Guarantee < 0 || pq.Guarantee > 1e6 {
			add(field+".guarantee", ReasonOutOfRange, "guarantee %g GPUs; want 0 to 1e6", pq.Guarantee)
		}
		if pq.Max != nil && (*pq.Max < pq.Guarantee || *pq.Max > 1e6) {
			add(field+".max", ReasonOutOfRange, "max %g GPUs; want at least the guarantee (%g) and at most 1e6", *pq.Max, pq.Guarantee)
		}
	}
	return newValidationError(errs)
}

// PoolConfig is an administrator's settings of one pool, stored in
// BucketPools under the pool name.
type PoolConfig struct {
	SchemaVersion int             `json:"schemaVersion,omitempty"`
	Pool          string          `json:"pool"`
	Policy        PlacementPolicy `json:"policy"`
	// Runtime is what the pool's machines may run (host commands,
	// mounts, host network); nil: the platform's default, images only.
	Runtime   *PoolRuntime `json:"runtime,omitempty"`
	UpdatedAt time.Time    `json:"updatedAt,omitzero"`
}

// Validate checks a pool configuration stored for pool.
func (c PoolConfig) Validate(pool string) error {
	var errs []FieldError
	if err := ValidatePool(pool); err != nil {
		errs = append(errs, FieldError{Field: "pool", Reason: ReasonInvalidValue, Message: err.Error()})
	} else if c.Pool != "" && c.Pool != pool {
		errs = append(errs, FieldError{Field: "pool", Reason: ReasonInvalidValue,
			Message: fmt.Sprintf("config names pool %q but is stored for %q", c.Pool, pool)})
	}
	if !c.Policy.Valid() {
		errs = append(errs, FieldError{Field: "policy", Reason: ReasonInvalidValue,
			Message: fmt.Sprintf("unknown policy %q; want one of %v", c.Policy, PlacementPolicies)})
	}
	c.Runtime.validate(func(field string, reason Reason, format string, args ...any) {
		errs = append(errs, FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	})
	return newValidationError(errs)
}

// NodeAdmin is an administrator's hold on one node, stored in
// BucketNodeAdmin. A cordoned node takes no new work (the resource manager
// refuses it too); a drained node is cordoned and its jobs are moved off
// (checkpointed first when they can), as preemption moves them.
//
// Holds are also written by the platform itself, with a Cause: the
// autoscaler drains a spot machine on its interruption notice
// (spot_interruption, with the reclaim Deadline) and an idle machine before
// deleting it; the scheduler holds GPUs the monitor's alerts name (GPUs).
// Uncordoning a node (deleting its key) lifts every hold on it.
type NodeAdmin struct {
	SchemaVersion int    `json:"schemaVersion,omitempty"`
	NodeID        string `json:"nodeId"`
	Cordoned      bool   `json:"cordoned"`
	Drain         bool   `json:"drain,omitempty"`
	Reason        string `json:"reason,omitempty"`
	// Cause is the move reason of a drain the platform wrote
	// (spot_interruption); empty for an administrator's (node_drained).
	Cause Reason `json:"cause,omitempty"`
	// Deadline is when the node goes away (a spot reclaim).
	Deadline *time.Time `json:"deadline,omitempty"`
	// GPUs holds single GPUs, by UUID, on a node that may otherwise take
	// work.
	GPUs map[string]GPUHold `json:"gpus,omitempty"`
	Time time.Time          `json:"time,omitzero"`
}

// GPUHold keeps new work off one GPU (Cordoned) and, with Drain, moves its
// runs away. Cause is the move reason (gpu_unhealthy, overheating); a hold
// with Cause overheating is lifted when its alert resolves, one with
// gpu_unhealthy stays until an administrator uncordons the node.
type GPUHold struct {
	Cordoned bool      `json:"cordoned"`
	Drain    bool      `json:"drain,omitempty"`
	Cause    Reason    `json:"cause,omitempty"`
	Reason   string    `json:"reason,omitempty"`
	Alert    string    `json:"alert,omitempty"` // the alert key that set it
	Since    time.Time `json:"since,omitzero"`
}

// DecodeNodeAdmin reads the hold document stored under the key node. The
// key names the node, whatever the value says. A value that does not
// decode holds the node (fail closed: someone meant something by it), and
// the error is returned for the caller's log; every reader (resource
// manager, scheduler, monitor, gateway) reads holds this way, so they
// agree on what an unreadable one means.
func DecodeNodeAdmin(node string, value []byte) (NodeAdmin, error) {
	var a NodeAdmin
	if err := json.Unmarshal(value, &a); err != nil {
		return NodeAdmin{NodeID: node, Cordoned: true, Reason: "unreadable admin record: " + err.Error()},
			fmt.Errorf("hold of node %s: %w", node, err)
	}
	a.NodeID = node
	return a, nil
}

// Empty reports whether the document holds nothing any more: no cordon,
// no drain, no cause, no GPU held.
func (a *NodeAdmin) Empty() bool {
	return !a.Cordoned && !a.Drain && a.Cause == "" && a.Deadline == nil && len(a.GPUs) == 0
}

// Held reports whether the hold keeps new work off GPU uuid.
func (a *NodeAdmin) Held(uuid string) bool {
	if a == nil {
		return false
	}
	h, ok := a.GPUs[uuid]
	return a.Cordoned || (ok && (h.Cordoned || h.Drain))
}

// Scheduling reasons: pending codes beyond placement, preemption and
// dependency outcomes.
const (
	// PendingQuotaExceeded: placing the job would take its tenant past
	// its maximum in the pool.
	PendingQuotaExceeded Reason = "quota_exceeded"
	// PendingDependencies: a job named in dependsOn has not succeeded yet.
	PendingDependencies Reason = "waiting_for_dependencies"
	// PendingReservedForOther: the free capacity is reserved for a larger
	// job ahead that backfill must not delay.
	PendingReservedForOther Reason = "reserved_for_job_ahead"
	// PendingStrictFIFO: the tenant's queue is strict and an earlier job
	// of it waits.
	PendingStrictFIFO Reason = "strict_fifo_blocked"
	// PendingPreempting: victims were chosen for this job and are being
	// stopped; it takes their devices when they are released.
	PendingPreempting Reason = "preempting"
	// PendingReleasing: the job's previous attempt still holds its
	// allocation (its run ended, the resource manager has not released
	// it yet); the next attempt is placed once it is released, as the
	// resource manager refuses a second live attempt of one job.
	PendingReleasing Reason = "releasing_previous_attempt"
	// PendingNoSchedulableNode: every node that has the GPUs is cordoned,
	// tainted, unselected, or short of CPU or host memory.
	PendingNoSchedulableNode Reason = "no_schedulable_node"
	// PendingBudget: (reserved) billing holds the tenant.

	// ReasonPreempted: the job was stopped to make room for another (a
	// higher priority, or a tenant reclaiming its guarantee) and requeued.
	ReasonPreempted Reason = "preempted"
	// ReasonDrained: the job was moved off a node an administrator drained.
	ReasonDrained Reason = "node_drained"
	// ReasonGPUUnhealthy: the job was moved off a GPU its node reports
	// unhealthy (XID, double-bit ECC, lost from the bus), checkpointed
	// first when it can, and requeued on healthy devices.
	ReasonGPUUnhealthy Reason = "gpu_unhealthy"
	// ReasonSpotInterruption: the job was moved off a spot machine the
	// provider gave notice it will reclaim.
	ReasonSpotInterruption Reason = "spot_interruption"
	// ReasonOverheating: the job was moved off a GPU running above its
	// slowdown temperature (the monitor's drain_gpu alert).
	ReasonOverheating Reason = "overheating"
	// ReasonDefragment: the job was moved to consolidate small jobs, so
	// that a pending job could start on the whole GPUs or machine freed.
	ReasonDefragment Reason = "defragment"
	// ReasonDependencyFailed: a job named in dependsOn failed or was
	// cancelled, so this one is cancelled.
	ReasonDependencyFailed Reason = "dependency_failed"
	// ReasonPlacementTimeout: the job (usually a gang) was not placed in
	// full within its placementTimeout.
	ReasonPlacementTimeout Reason = "placement_timeout"
	// ReasonGangIncomplete: part of a gang was refused by the resource
	// manager; the parts that were committed are released and the whole
	// gang retried.
	ReasonGangIncomplete Reason = "gang_incomplete"
	// ReasonDependencyCycle: dependsOn would close a cycle.
	ReasonDependencyCycle Reason = "dependency_cycle"
	// ReasonUnknownDependency: dependsOn names a job the tenant never
	// submitted.
	ReasonUnknownDependency Reason = "unknown_dependency"
	// RefusedNodeCordoned: the node is cordoned or draining, or a GPU of the
	// item is held.
	RefusedNodeCordoned Reason = "node_cordoned"
)

// Limits of the scheduling parts of a request.
const (
	MaxNodesPerJob     = 128
	MaxDependsOn       = 64
	MaxTolerations     = 32
	MaxSelectorLabels  = 32
	MaxAllowedModels   = 16
	MaxPlacementWait   = 7 * 24 * time.Hour
	MaxExpectedRunTime = MaxJobDuration
)

// validateScheduling adds the field errors of the scheduling parts of r.
func (r *JobRequest) validateScheduling(add func(field string, reason Reason, format string, args ...any)) {
	g := r.Resources.GPU
	if len(g.Models) > MaxAllowedModels {
		add("resources.gpu.models", ReasonOutOfRange, "%d models, limit is %d", len(g.Models), MaxAllowedModels)
	}
	for _, m := range g.Models {
		if !KnownGPUModel(m) {
			add("resources.gpu.models", ReasonUnknownGPUModel, "unknown GPU model %q; want one of %v", m, GPUModels)
		}
	}
	if len(g.Models) > 0 && g.Model != "" && g.Model != GPUModelAny {
		add("resources.gpu.models", ReasonConflictingRun, "set model or models, not both")
	}
	if g.MIGProfile != "" {
		if g.Share != nil {
			add("resources.gpu.share", ReasonInvalidValue, "a request is a MIG instance or a share, not both")
		}
		if g.Count != 1 {
			add("resources.gpu.count", ReasonOutOfRange, "a MIG request takes one instance; count is %d", g.Count)
		}
		known := false
		models := g.Models
		if g.Model != "" && g.Model != GPUModelAny {
			models = []string{g.Model}
		}
		if len(models) == 0 {
			models = MIGModels()
		}
		for _, m := range models {
			if _, ok := migProfile(m, g.MIGProfile); ok {
				known = true
			}
		}
		if !known {
			add("resources.gpu.migProfile", ReasonInvalidValue, "no allowed model has MIG profile %q; MIG-capable models are %v",
				g.MIGProfile, MIGModels())
		}
	}
	if s := g.Share; s != nil {
		if g.Count != 1 {
			add("resources.gpu.count", ReasonOutOfRange, "a share is of one GPU; count is %d", g.Count)
		}
		if s.ComputePercent < 1 || s.ComputePercent > 99 {
			add("resources.gpu.share.computePercent", ReasonOutOfRange, "compute share %d%%; want 1 to 99 (ask for a whole GPU instead)", s.ComputePercent)
		}
		if s.MemoryMiB < 1 || s.MemoryMiB > MaxGPUMemoryMiB {
			add("resources.gpu.share.memoryMiB", ReasonOutOfRange, "share memory %d MiB; want 1 to %d", s.MemoryMiB, MaxGPUMemoryMiB)
		}
	}
	switch {
	case g.Nodes < 0 || g.Nodes > MaxNodesPerJob:
		add("resources.gpu.nodes", ReasonOutOfRange, "nodes is %d; want 0 to %d machines (0 or 1: one machine)", g.Nodes, MaxNodesPerJob)
	case g.Nodes > 1 && (g.MIGProfile != "" || g.Share != nil):
		add("resources.gpu.nodes", ReasonInvalidValue, "a MIG instance or a share runs on one machine")
	case g.Nodes > 1 && g.Count%g.Nodes != 0:
		add("resources.gpu.nodes", ReasonInvalidValue, "count %d does not split evenly over %d machines", g.Count, g.Nodes)
	}
	if !slices.Contains(Topologies, g.Topology) {
		add("resources.gpu.topology", ReasonInvalidValue, "unknown topology %q; want %q, %q or empty", g.Topology, TopologyNVLink, TopologyZone)
	}
	if len(r.NodeSelector) > MaxSelectorLabels {
		add("nodeSelector", ReasonOutOfRange, "%d labels, limit is %d", len(r.NodeSelector), MaxSelectorLabels)
	}
	for k, v := range r.NodeSelector {
		if k == "" || len(k)+len(v) > MaxLabelBytes {
			add("nodeSelector", ReasonInvalidValue, "label %q is empty or longer than %d bytes", k, MaxLabelBytes)
		}
	}
	if len(r.Tolerations) > MaxTolerations {
		add("tolerations", ReasonOutOfRange, "%d tolerations, limit is %d", len(r.Tolerations), MaxTolerations)
	}
	for i, t := range r.Tolerations {
		field := fmt.Sprintf("tolerations[%d]", i)
		switch t.Operator {
		case "", TolerationEqual:
			if t.Key == "" {
				add(field, ReasonInvalidValue, "operator Equal needs a key")
			}
		case TolerationExists:
			if t.Value != "" {
				add(field, ReasonInvalidValue, "operator Exists takes no value")
			}
		default:
			add(field, ReasonInvalidValue, "unknown operator %q; want Equal or Exists", t.Operator)
		}
		if t.Effect != "" && t.Effect != TaintNoSchedule && t.Effect != TaintPreferNoSchedule {
			add(field, ReasonInvalidValue, "unknown effect %q; want NoSchedule or PreferNoSchedule", t.Effect)
		}
	}
	if len(r.DependsOn) > MaxDependsOn {
		add("dependsOn", ReasonOutOfRange, "%d dependencies, limit is %d", len(r.DependsOn), MaxDependsOn)
	}
	for _, d := range r.DependsOn {
		switch {
		case ValidateID(d) != nil:
			add("dependsOn", ReasonInvalidID, "%v", ValidateID(d))
		case d == r.ID:
			add("dependsOn", ReasonDependencyCycle, "job %q depends on itself", d)
		}
	}
	if r.PlacementTimeout < 0 || r.PlacementTimeout.D() > MaxPlacementWait {
		add("placementTimeout", ReasonOutOfRange, "placement timeout %s; want 0 (none) to %s", r.PlacementTimeout.D(), MaxPlacementWait)
	}
	if r.ExpectedRunTime < 0 || r.ExpectedRunTime.D() > MaxExpectedRunTime {
		add("expectedRunTime", ReasonOutOfRange, "expected run time %s; want 0 (unknown) to %s", r.ExpectedRunTime.D(), MaxExpectedRunTime)
	}
}

// Kind of GPU a request asks for.
type GPUKind string

const (
	GPUKindWhole GPUKind = "whole"
	GPUKindMIG   GPUKind = "mig"
	GPUKindShare GPUKind = "share"
)

// Kind says whether g asks for whole GPUs, a MIG instance or a share.
func (g GPURequest) Kind() GPUKind {
	switch {
	case g.MIGProfile != "":
		return GPUKindMIG
	case g.Share != nil:
		return GPUKindShare
	}
	return GPUKindWhole
}

// AllowedModels is the list of models g may run on; nil means any.
func (g GPURequest) AllowedModels() []string {
	if len(g.Models) > 0 {
		return g.Models
	}
	if g.Model == "" || g.Model == GPUModelAny {
		return nil
	}
	return []string{g.Model}
}

// Machines is how many machines the job's GPUs span (at least 1).
func (g GPURequest) Machines() int { return max(1, g.Nodes) }

// MilliGPUs is the request's size in thousandths of a GPU, as quotas and
// fair share count it: whole GPUs 1000 each, a share its compute percent,
// a MIG instance its compute slices over 7 (a 1g instance is 142, a 7g a
// whole GPU).
func (g GPURequest) MilliGPUs() int64 {
	switch g.Kind() {
	case GPUKindShare:
		return int64(g.Share.ComputePercent) * 10
	case GPUKindMIG:
		slices := 1
		if i := strings.IndexByte(g.MIGProfile, 'g'); i > 0 {
			// "3g.40gb": the compute slices are the leading digits.
			n := 0
			for _, c := range g.MIGProfile[:i] {
				if c < '0' || c > '9' {
					n = 0
					break
				}
				n = n*10 + int(c-'0')
			}
			if n > 0 {
				slices = n
			}
		}
		return int64(slices) * 1000 / 7
	}
	return int64(g.Count) * 1000
}
