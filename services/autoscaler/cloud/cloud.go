// Package cloud is the vocabulary the autoscaler and a cloud provider share:
// a machine, a request to create one, and the provider's answers that are
// not failures of the provider itself (no quota, no capacity). The Provider
// interface lives where it is consumed (package actuate).
package cloud

import (
	"errors"
	"time"
)

// State is where a machine is in its life at the provider.
type State string

const (
	// Provisioning: created, not yet booted; its node agent is not up.
	Provisioning State = "provisioning"
	// Running: booted; its node agent registers with the bus.
	Running State = "running"
	// Deleted: gone (deleted, or reclaimed after a spot interruption). A
	// provider keeps deleted machines listed under their token so that a
	// token is never reused for a second machine.
	Deleted State = "deleted"
)

// Price classes of a pool's machines.
const (
	OnDemand = "on-demand"
	Spot     = "spot"
)

// CreateRequest asks for one machine. Token is the idempotency token: two
// requests with one token yield one machine, whatever the number of calls
// or lost replies.
type CreateRequest struct {
	Token       string
	Pool        string
	MachineType string
	PriceClass  string
}

// Machine is one machine at the provider. NodeID is the ID its node agent
// registers under, so the autoscaler can match it with the ledger.
type Machine struct {
	ID          string
	NodeID      string
	Token       string
	Pool        string
	MachineType string
	PriceClass  string
	State       State
	Created     time.Time
	// Interruption is when a spot machine is reclaimed; zero when no notice
	// was given.
	Interruption time.Time
}

// Answers of a healthy provider that refuses a request. They are not
// provider failures: a circuit breaker counts them as successes, and the
// caller backs off the pool rather than the provider.
var (
	ErrQuota    = errors.New("cloud: quota exceeded")
	ErrCapacity = errors.New("cloud: no capacity for machine type")
	ErrNotFound = errors.New("cloud: no such machine")
)

// IsRefusal reports whether err is a healthy provider's refusal.
func IsRefusal(err error) bool {
	return errors.Is(err, ErrQuota) || errors.Is(err, ErrCapacity) || errors.Is(err, ErrNotFound)
}
