package contracts

import "time"

// BucketLeases holds leader leases, one key per singleton role: the
// scheduler's lease is under LeaseKeyScheduler(name). A value is a Lease;
// it is only ever written with compare-and-set (create, or update at the
// revision read), so exactly one contender wins each term.
const BucketLeases = "gp-leases"

// LeaseKeyScheduler is the lease key of the scheduler whose plans go to
// SubjectPlan(name): its replicas all share name and contend for this key.
func LeaseKeyScheduler(name string) string { return "scheduler." + name }

// LeaseKeyResourceManager is the lease of the one resource manager that
// writes the ledger and decides node lifecycle; its replicas are standbys.
const LeaseKeyResourceManager = "resource-manager"

// LeaseKeyAutoscaler is the lease of the one autoscaler that acts on the
// provider and writes scale decisions; its replicas are standbys.
const LeaseKeyAutoscaler = "autoscaler"

// LeaseKeyMonitor is the lease of the one monitor replica that publishes
// alerts; every replica serves metrics.
const LeaseKeyMonitor = "monitor"

// Lease is the value of a leader lease. Epoch is the fencing token: it
// grows by one each time leadership changes hands and never goes back, so
// a reader refuses work stamped with an older epoch (RefusedStaleEpoch).
// A holder that has not renewed by Expires has lost the lease; a standby
// may take it over from then on.
type Lease struct {
	SchemaVersion int       `json:"schemaVersion"`
	Holder        string    `json:"holder"`
	Epoch         uint64    `json:"epoch"`
	Expires       time.Time `json:"expires"`
}
