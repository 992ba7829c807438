package contracts

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Who may do what on the bus. Every subject family of subjects.go and every
// KV bucket is listed once in Families and Buckets with the roles that may
// publish (write) and read it; Access derives the NATS permissions of an
// identity from these two tables alone, and the forgery test in libs/natsauth
// checks the NATS server against the same tables. A subject added to
// subjects.go without a row here is refused to everyone (and the test that
// every Subject*All constant has a row fails), so the two cannot drift.

// BusRole is what an identity on the bus is for.
type BusRole string

// The roles. A node agent and a tenant are scoped: each identity of those
// roles carries the one node or tenant it speaks for, and its permissions
// name that scope's subjects literally.
const (
	// BusOperator administers the bus: streams, consumers, every subject.
	BusOperator BusRole = "operator"
	// BusAdmin is a platform administrator on the bus: it may publish
	// what the gateway's admin paths publish and write every KV bucket,
	// but not administer streams (no purge, delete or edit).
	BusAdmin           BusRole = "admin"
	BusScheduler       BusRole = "scheduler"
	BusResourceManager BusRole = "resource-manager"
	BusMonitor         BusRole = "monitor"
	BusAutoscaler      BusRole = "autoscaler"
	BusBilling         BusRole = "billing"
	BusGateway         BusRole = "gateway"
	// BusNode is one node agent, scoped to its node.
	BusNode BusRole = "node-agent"
	// BusFleet is a process of simulated node agents (fleet-sim, the
	// simulated cloud of `make run`): it speaks for every node, so it is
	// for development and test fleets only, never for real machines.
	BusFleet BusRole = "fleet"
	// BusTenant is a tenant's client, scoped to its tenant.
	BusTenant BusRole = "tenant"
)

// BusRoles lists every role, for tables and validation.
var BusRoles = []BusRole{BusOperator, BusAdmin, BusScheduler, BusResourceManager, BusMonitor, BusAutoscaler,
	BusBilling, BusGateway, BusNode, BusFleet, BusTenant}

// Scoped reports whether identities of r each speak for one node or tenant.
func (r BusRole) Scoped() bool { return r == BusNode || r == BusTenant }

// ScopeKind says which token of a subject family names what.
type ScopeKind int

const (
	// ScopeNone: the family's variable token is not a node or tenant.
	ScopeNone ScopeKind = iota
	// ScopeNode: the family's variable token is the node.
	ScopeNode
	// ScopeTenant: the family's variable token is the tenant.
	ScopeTenant
)

// Family is one subject family: its wildcard, the stream that stores it,
// and who may publish and read it.
type Family struct {
	// Wildcard is the Subject*All constant.
	Wildcard string
	// Stream stores the family.
	Stream string
	// Scope says what the family's first variable token names.
	Scope ScopeKind
	// Scoped returns the subjects of one scope (node or tenant): the
	// literal subject, or the scope's wildcard when tokens follow it.
	Scoped func(scope string) string
	// NodeScoped, on a tenant-scoped family that node agents publish,
	// returns the subjects one node may publish (its own token in them).
	NodeScoped func(node string) string
	// Publishers may publish; scoped roles only on their own scope.
	Publishers []BusRole
	// Readers may subscribe and create consumers; scoped roles only on
	// their own scope.
	Readers []BusRole
}

// services are the platform's own services, which all read node facts.
var services = []BusRole{BusScheduler, BusResourceManager, BusMonitor, BusAutoscaler, BusBilling, BusGateway}

func roles(rs ...any) []BusRole {
	var out []BusRole
	for _, r := range rs {
		switch v := r.(type) {
		case BusRole:
			out = append(out, v)
		case []BusRole:
			out = append(out, v...)
		}
	}
	return out
}

// Families lists every subject family of the platform. The operator may
// publish and read every family and is not listed.
var Families = []Family{
	{Wildcard: SubjectSubmitAll, Stream: StreamJobs, Scope: ScopeTenant, Scoped: SubjectSubmit,
		Publishers: roles(BusTenant, BusGateway, BusAdmin), Readers: roles(BusScheduler, BusGateway)},
	{Wildcard: SubjectCancelAll, Stream: StreamJobs, Scope: ScopeTenant, Scoped: SubjectCancel,
		Publishers: roles(BusTenant, BusGateway, BusAdmin), Readers: roles(BusScheduler, BusGateway)},
	{Wildcard: SubjectJobEventsAll, Stream: StreamJobEvents, Scope: ScopeTenant,
		Scoped:     func(t string) string { return "gp.jobs.events." + t + ".>" },
		Publishers: roles(BusScheduler), Readers: roles(BusTenant, BusScheduler, BusGateway, BusMonitor, BusBilling, BusAdmin)},
	{Wildcard: SubjectPlansAll, Stream: StreamPlans, Scope: ScopeNone,
		Publishers: roles(BusScheduler), Readers: roles(BusResourceManager, BusScheduler)},
	{Wildcard: SubjectLedgerAll, Stream: StreamAllocations, Scope: ScopeNode, Scoped: SubjectLedger,
		Publishers: roles(BusResourceManager),
		Readers:    roles(BusNode, BusFleet, services, BusAdmin)},
	{Wildcard: SubjectRefusedAll, Stream: StreamAllocations, Scope: ScopeTenant, Scoped: SubjectRefused,
		Publishers: roles(BusResourceManager), Readers: roles(BusScheduler, BusResourceManager, BusAdmin)},
	{Wildcard: SubjectRunsAll, Stream: StreamRuns, Scope: ScopeNode, Scoped: SubjectRuns,
		Publishers: roles(BusNode, BusFleet), Readers: roles(BusNode, BusFleet, services, BusAdmin)},
	{Wildcard: SubjectInventoryAll, Stream: StreamNodes, Scope: ScopeNode, Scoped: SubjectInventory,
		Publishers: roles(BusNode, BusFleet), Readers: roles(BusNode, BusFleet, services, BusAdmin)},
	{Wildcard: SubjectNodeLifecycleAll, Stream: StreamNodes, Scope: ScopeNode, Scoped: SubjectNodeLifecycle,
		Publishers: roles(BusResourceManager), Readers: roles(BusNode, BusFleet, services, BusAdmin)},
	{Wildcard: SubjectNodeHealthAll, Stream: StreamNodes, Scope: ScopeNode, Scoped: SubjectNodeHealth,
		Publishers: roles(BusNode, BusFleet), Readers: roles(BusNode, BusFleet, services, BusAdmin)},
	{Wildcard: SubjectHeartbeatAll, Stream: StreamHeartbeats, Scope: ScopeNode, Scoped: SubjectHeartbeat,
		Publishers: roles(BusNode, BusFleet), Readers: roles(services, BusAdmin)},
	{Wildcard: SubjectTelemetryAll, Stream: StreamTelemetry, Scope: ScopeNode, Scoped: SubjectTelemetry,
		Publishers: roles(BusNode, BusFleet), Readers: roles(services, BusAdmin)},
	// The gateway publishes the commands an administrator or a tenant asks
	// for directly (inject a fault, checkpoint a job); the scheduler the
	// ones its decisions need (stop, migrate).
	{Wildcard: SubjectNodeCommandsAll, Stream: StreamNodeCommands, Scope: ScopeNode, Scoped: SubjectNodeCommands,
		Publishers: roles(BusScheduler, BusGateway), Readers: roles(BusNode, BusFleet, BusScheduler, BusGateway, BusAdmin)},
	{Wildcard: SubjectDemandAll, Stream: StreamOps, Scope: ScopeNone,
		Publishers: roles(BusScheduler), Readers: roles(services, BusAdmin)},
	{Wildcard: SubjectScaleAll, Stream: StreamOps, Scope: ScopeNone,
		Publishers: roles(BusAutoscaler), Readers: roles(services, BusAdmin)},
	{Wildcard: SubjectMachinesAll, Stream: StreamOps, Scope: ScopeNone,
		Publishers: roles(BusAutoscaler), Readers: roles(services, BusFleet, BusAdmin)},
	{Wildcard: SubjectAlertsAll, Stream: StreamOps, Scope: ScopeNone,
		Publishers: roles(BusMonitor, BusAutoscaler, BusBilling), Readers: roles(services, BusAdmin)},
	{Wildcard: SubjectUsageAll, Stream: StreamUsage, Scope: ScopeTenant, Scoped: SubjectUsage,
		Publishers: roles(BusBilling), Readers: roles(BusTenant, BusBilling, BusGateway, BusAdmin)},
	{Wildcard: SubjectLogsAll, Stream: StreamLogs, Scope: ScopeTenant,
		Scoped:     func(t string) string { return "gp.logs." + t + ".>" },
		NodeScoped: func(node string) string { return "gp.logs.*.*." + node },
		Publishers: roles(BusNode, BusFleet), Readers: roles(BusTenant, BusGateway, BusAdmin)},
	// Every consumer of the bus library parks what it gives up on here;
	// a node agent only under its own consumer's name (NodeConsumer).
	{Wildcard: SubjectDeadLetterAll, Stream: StreamDeadLetters, Scope: ScopeNode,
		Scoped:     func(node string) string { return "gp.dlq.*." + NodeConsumer(node) },
		Publishers: roles(BusNode, BusFleet, services), Readers: roles(BusAdmin)},
	// The audit trail: only the gateway writes it (one hash chain,
	// contracts/audit.go); it and administrators read it.
	{Wildcard: SubjectAuditAll, Stream: StreamAudit, Scope: ScopeNone,
		Publishers: roles(BusGateway), Readers: roles(BusGateway, BusAdmin)},
}

// BucketAccess says who may read and write one KV bucket.
type BucketAccess struct {
	Bucket  string
	Writers []BusRole
	// KeyWriters may write only the listed keys.
	KeyWriters map[BusRole][]string
	Readers    []BusRole
}

// Buckets lists every KV bucket of contracts.KeyValues. Prices, budgets,
// quotas and pool policies are written only by the gateway (its admin
// paths check the caller's role) and the bus administrator.
var Buckets = []BucketAccess{
	{Bucket: BucketPriceBook, Writers: roles(BusGateway, BusAdmin),
		KeyWriters: map[BusRole][]string{BusBilling: {KeyMeteredUntil}}, Readers: roles(BusBilling, BusGateway, BusAdmin)},
	{Bucket: BucketBudgets, Writers: roles(BusGateway, BusAdmin), Readers: roles(BusBilling, BusGateway, BusAdmin)},
	{Bucket: BucketBudgetStatus, Writers: roles(BusBilling), Readers: roles(BusScheduler, BusGateway, BusBilling, BusAdmin)},
	{Bucket: BucketLeases, Writers: roles(services), Readers: roles(services, BusAdmin)},
	// Snapshots (snapshots.go): the scheduler writes the bucket, the
	// resource manager and the gateway only their own keys (RMSnapshotKeys,
	// GatewaySnapshotKeys).
	{Bucket: BucketSnapshots, Writers: roles(BusScheduler),
		KeyWriters: map[BusRole][]string{BusResourceManager: {RMSnapshotKeys}, BusGateway: {GatewaySnapshotKeys},
			BusBilling: {BillingSnapshotKeys}},
		Readers: roles(BusScheduler, BusResourceManager, BusGateway, BusBilling, BusAdmin)},
	{Bucket: BucketQuotas, Writers: roles(BusGateway, BusAdmin), Readers: roles(services, BusAdmin)},
	{Bucket: BucketPools, Writers: roles(BusGateway, BusAdmin), Readers: roles(services, BusAdmin)},
	// Node holds: cordon and drain by administrators (the gateway), spot
	// notices and scale-down drains by the autoscaler, and the GPU holds
	// the scheduler sets and lifts on a GPU's alerts (scheduler/alerts.go).
	{Bucket: BucketNodeAdmin, Writers: roles(BusGateway, BusAutoscaler, BusScheduler, BusAdmin),
		Readers: roles(services, BusFleet, BusAdmin)},
	// Identity (identity.go): role bindings and token hashes are the
	// gateway's (its identity endpoints check the caller's role); the bus
	// administrator bootstraps the first platform admin.
	{Bucket: BucketRoleBindings, Writers: roles(BusGateway, BusAdmin), Readers: roles(BusGateway, BusAdmin)},
	{Bucket: BucketAPITokens, Writers: roles(BusGateway, BusAdmin), Readers: roles(BusGateway, BusAdmin)},
	{Bucket: BucketQuotaGrants, Writers: roles(BusGateway, BusAdmin), Readers: roles(BusGateway, BusAdmin)},
	// Tenants' registry logins (runtime.go): secrets that only the node
	// agents (and the simulated fleet's, which run containers in `make
	// run`) read, to pull private images; only a platform administrator
	// on the bus writes them. No service, not even the gateway, reads them.
	{Bucket: BucketRegistryCredentials, Writers: roles(BusAdmin), Readers: roles(BusNode, BusFleet)},
}

// NodeConsumer is the durable consumer name of node's agent (one per
// stream it reads). It is the only consumer name a node identity may use.
func NodeConsumer(node string) string { return "node-agent-" + node }

// NodeReplayPrefix is the name prefix of the ordered consumers a node
// agent replays its own subjects with (nats.go appends _<n>). The
// "node-replay-" prefix can never equal a NodeConsumer name, and since n is
// a number after the last '_', no two nodes share a replay name.
func NodeReplayPrefix(node string) string { return "node-replay-" + node }

// NodeReplayResets is how many resets of one replay a node agent's
// permissions cover; a replay that needs more fails and is started again
// (from _1).
const NodeReplayResets = 8

// TenantConsumer is the consumer name a tenant identity may create on the
// streams it reads (JOB_EVENTS, USAGE, LOGS). The "tenant_" prefix keeps
// it apart from every service's consumer name, so a tenant can never
// create, update or read from a service's consumer.
func TenantConsumer(tenant string) string { return "tenant_" + tenant }

// Identity is one principal on the bus.
type Identity struct {
	// Name is unique: the service name, "node-<id>", "tenant-<t>".
	Name string
	Role BusRole
	// Scope is the node or tenant of a scoped role.
	Scope string
}

// InboxPrefix is the prefix of an identity's reply subjects. Each identity
// may subscribe only under its own prefix, so no client can read the
// replies (and JetStream pull deliveries) addressed to another.
func (id Identity) InboxPrefix() string { return "_INBOX." + id.Name }

// Validate checks the identity's name, role and scope.
func (id Identity) Validate() error {
	if !slices.Contains(BusRoles, id.Role) {
		return fmt.Errorf("identity %q: unknown role %q", id.Name, id.Role)
	}
	if id.Name == "" || strings.ContainsAny(id.Name, ".*> \t\r\n") {
		return fmt.Errorf("identity %q: a name is one subject token", id.Name)
	}
	switch id.Role {
	case BusNode:
		if err := ValidateID(id.Scope); err != nil {
			return fmt.Errorf("identity %q: node: %w", id.Name, err)
		}
	case BusTenant:
		if err := ValidateTenant(id.Scope); err != nil {
			return fmt.Errorf("identity %q: %w", id.Name, err)
		}
	default:
		if id.Scope != "" {
			return fmt.Errorf("identity %q: role %s takes no scope", id.Name, id.Role)
		}
	}
	return nil
}

// Permissions are allow lists of subjects, as NATS user permissions.
type Permissions struct {
	Publish   []string
	Subscribe []string
	// DenyPublish is subtracted from Publish.
	DenyPublish []string
}

// Access derives the bus permissions of id from Families and Buckets.
func Access(id Identity) (Permissions, error) {
	if err := id.Validate(); err != nil {
		return Permissions{}, err
	}
	var p Permissions
	pub := func(s ...string) { p.Publish = append(p.Publish, s...) }
	sub := func(s ...string) { p.Subscribe = append(p.Subscribe, s...) }
	if id.Role == BusOperator {
		pub(">")
		sub(">")
		return p, nil
	}
	sub(id.InboxPrefix() + ".>")
	pub("$JS.API.INFO")

	readStreams := map[string]bool{}
	// scopedReads are the consumer filters a scoped identity may use, per
	// stream.
	scopedReads := map[string][]string{}
	for _, f := range Families {
		if slices.Contains(f.Publishers, id.Role) {
			if subj, ok := familySubject(f, id); ok {
				pub(subj)
			}
		}
		if slices.Contains(f.Readers, id.Role) {
			if subj, ok := familySubject(f, id); ok {
				sub(subj)
				readStreams[f.Stream] = true
				if id.Role.Scoped() {
					scopedReads[f.Stream] = append(scopedReads[f.Stream], subj)
				}
			}
		}
	}
	for _, stream := range slices.Sorted(maps.Keys(readStreams)) {
		pub("$JS.API.STREAM.INFO." + stream)
		if id.Role.Scoped() {
			name := consumerName(id)
			for _, filter := range scopedReads[stream] {
				// The filter is part of the create subject (nats.go puts a
				// single filter there), and the server checks the body's
				// filter against it, so a scoped identity cannot widen it.
				pub("$JS.API.CONSUMER.CREATE." + stream + "." + name + "." + filter)
			}
			pub("$JS.API.CONSUMER.INFO."+stream+"."+name, "$JS.API.CONSUMER.DELETE."+stream+"."+name,
				"$JS.API.CONSUMER.MSG.NEXT."+stream+"."+name, "$JS.ACK."+stream+"."+name+".>")
			if id.Role == BusNode {
				// A node agent also replays its subjects with ordered
				// consumers, which nats.go names <prefix>_<n>, n counting
				// the consumer's resets from 1: it may use those names
				// alone, so it can never pull from, or delete, another
				// node's or a service's consumer. Its replay starts from
				// the last message of its subject (bus.Replay): a direct
				// get whose subject names the node's own subject, so it
				// reads nothing else.
				for _, filter := range scopedReads[stream] {
					pub("$JS.API.DIRECT.GET." + stream + "." + filter)
				}
				for n := 1; n <= NodeReplayResets; n++ {
					rn := fmt.Sprintf("%s_%d", NodeReplayPrefix(id.Scope), n)
					for _, filter := range scopedReads[stream] {
						pub("$JS.API.CONSUMER.CREATE." + stream + "." + rn + "." + filter)
					}
					pub("$JS.API.CONSUMER.INFO."+stream+"."+rn, "$JS.API.CONSUMER.MSG.NEXT."+stream+"."+rn,
						"$JS.API.CONSUMER.DELETE."+stream+"."+rn)
				}
			}
			continue
		}
		pub("$JS.API.STREAM.MSG.GET."+stream, "$JS.API.DIRECT.GET."+stream, "$JS.API.DIRECT.GET."+stream+".>",
			"$JS.API.CONSUMER.CREATE."+stream+".>", "$JS.API.CONSUMER.DURABLE.CREATE."+stream+".>",
			"$JS.API.CONSUMER.INFO."+stream+".>", "$JS.API.CONSUMER.DELETE."+stream+".>",
			"$JS.API.CONSUMER.MSG.NEXT."+stream+".>", "$JS.API.CONSUMER.NAMES."+stream,
			"$JS.API.CONSUMER.LIST."+stream, "$JS.ACK."+stream+".>")
	}
	if !id.Role.Scoped() {
		// Services create the streams and buckets they need if missing
		// (bus.EnsureStreams); updating, purging and deleting them is the
		// operator's.
		// bus.EnsureStreams asks for each stream's info to learn whether it
		// is missing before creating it, also for streams the role does
		// not read: the info is config and counts, never a message.
		pub("$JS.API.STREAM.NAMES")
		for _, s := range StreamNames() {
			pub("$JS.API.STREAM.INFO."+s, "$JS.API.STREAM.CREATE."+s)
		}
	}
	for _, b := range Buckets {
		stream := "KV_" + b.Bucket
		write := slices.Contains(b.Writers, id.Role)
		keys := b.KeyWriters[id.Role]
		if !write && len(keys) == 0 && !slices.Contains(b.Readers, id.Role) {
			continue
		}
		switch {
		case write:
			pub("$KV." + b.Bucket + ".>")
		case len(keys) > 0:
			for _, k := range keys {
				pub("$KV." + b.Bucket + "." + k)
			}
		}
		// A watch is a push consumer with flow control: past ~1 MB
		// pending the server waits for a reply on $JS.FC.<stream>.…,
		// and without the grant a watch of many keys (kvsnap's parts)
		// stalls for good.
		pub("$JS.API.STREAM.INFO."+stream, "$JS.API.STREAM.CREATE."+stream,
			"$JS.API.STREAM.MSG.GET."+stream, "$JS.API.DIRECT.GET."+stream, "$JS.API.DIRECT.GET."+stream+".>",
			"$JS.API.CONSUMER.CREATE."+stream+".>", "$JS.API.CONSUMER.INFO."+stream+".>",
			"$JS.API.CONSUMER.DELETE."+stream+".>", "$JS.API.CONSUMER.MSG.NEXT."+stream+".>",
			"$JS.FC."+stream+".>")
	}
	p.Publish = dedupe(p.Publish)
	p.Subscribe = dedupe(p.Subscribe)
	return p, nil
}

// familySubject is the subject of f that id may use: the wildcard for an
// unscoped role, the scope's subjects for a scoped role on a family of its
// scope kind, nothing for a scoped role on another kind.
func familySubject(f Family, id Identity) (string, bool) {
	if !id.Role.Scoped() {
		return f.Wildcard, true
	}
	want := ScopeTenant
	if id.Role == BusNode {
		want = ScopeNode
		if f.Scope == ScopeTenant && f.NodeScoped != nil {
			return f.NodeScoped(id.Scope), true
		}
	}
	if f.Scope != want || f.Scoped == nil {
		return "", false
	}
	return f.Scoped(id.Scope), true
}

func consumerName(id Identity) string {
	if id.Role == BusNode {
		return NodeConsumer(id.Scope)
	}
	return TenantConsumer(id.Scope)
}

// StreamNames lists the platform's streams (contracts.Streams) by name.
func StreamNames() []string {
	var names []string
	for _, s := range Streams(StreamOptions{}) {
		names = append(names, s.Name)
	}
	return names
}

func dedupe(s []string) []string {
	seen := map[string]bool{}
	out := s[:0]
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}
