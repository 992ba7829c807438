package contracts

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// FaultKinds are the kinds a Fault may have.
var FaultKinds = []FaultKind{FaultXID, FaultECCDBE, FaultOverheat, FaultMachineDeath, FaultAgentPause, FaultClear}

// Default figures of a Fault whose fields are zero.
const (
	DefaultFaultXID   = 79 // fell off the bus
	DefaultAgentPause = 30 * time.Second
	MaxFaultDuration  = 24 * time.Hour
	maxXID            = 1 << 16
	maxFaultIDLength  = 128
	maxFaultGPULength = 64
)

// Validate reports every problem of a fault at once. ID is what an agent
// is idempotent on, so it is required.
func (f Fault) Validate() error {
	var errs []error
	switch {
	case f.ID == "":
		errs = append(errs, errors.New("fault ID is empty"))
	case len(f.ID) > maxFaultIDLength:
		errs = append(errs, fmt.Errorf("fault ID is %d bytes; want at most %d", len(f.ID), maxFaultIDLength))
	}
	if !slices.Contains(FaultKinds, f.Kind) {
		errs = append(errs, fmt.Errorf("fault kind %q; want one of %v", f.Kind, FaultKinds))
	}
	if len(f.GPU) > maxFaultGPULength {
		errs = append(errs, fmt.Errorf("fault GPU %q is too long; want an index or a GPU UUID", f.GPU))
	}
	if f.Code < 0 || f.Code >= maxXID {
		errs = append(errs, fmt.Errorf("fault code %d; want an XID from 1 to %d (0: %d)", f.Code, maxXID-1, DefaultFaultXID))
	} else if f.Code != 0 && f.Kind != FaultXID {
		errs = append(errs, fmt.Errorf("fault code %d is for kind %s only", f.Code, FaultXID))
	}
	if d := f.Duration.D(); d < 0 || d > MaxFaultDuration {
		errs = append(errs, fmt.Errorf("fault duration %s; want 0 to %s", d, MaxFaultDuration))
	} else if d != 0 && f.Kind != FaultOverheat && f.Kind != FaultAgentPause {
		errs = append(errs, fmt.Errorf("fault duration is for kinds %s and %s only", FaultOverheat, FaultAgentPause))
	}
	return errors.Join(errs...)
}

// XIDCode is the XID of an xid fault: Code, or 79 when it is 0.
func (f Fault) XIDCode() int {
	if f.Code == 0 {
		return DefaultFaultXID
	}
	return f.Code
}

// PauseDuration is how long an agent_pause lasts: Duration, or 30 s.
func (f Fault) PauseDuration() time.Duration {
	if f.Duration <= 0 {
		return DefaultAgentPause
	}
	return f.Duration.D()
}

// xidApplication are the XIDs a faulty application causes (an illegal
// memory access, a graphics engine exception, a stopped or preempted
// channel): the GPU is fine. They are the XIDs NVIDIA's Kubernetes device
// plugin and DCGM skip when judging a GPU's health.
var xidApplication = []int{13, 31, 43, 45, 68, 109}

// XIDUnhealthy reports whether an XID makes its GPU unusable for new work
// until a reset: every XID but the application errors, as NVIDIA's device
// plugin judges NVML's critical XID events (79 fell off the bus, 48
// double-bit ECC, 63/64 row remapping, 74 NVLink, 92/94/95 ECC, 119/120
// GSP, ...).
func XIDUnhealthy(code int) bool { return !slices.Contains(xidApplication, code) }

// xidText describes the XIDs a GPU platform meets most, in the words of
// NVIDIA's XID catalogue.
var xidText = map[int]string{
	13:  "graphics engine exception",
	31:  "GPU memory page fault",
	43:  "GPU stopped processing",
	45:  "preemptive cleanup, due to previous errors",
	48:  "double-bit ECC error",
	63:  "ECC page retirement or row remapping recording event",
	64:  "ECC page retirement or row remapper recording failure",
	68:  "video processor exception",
	74:  "NVLink error",
	79:  "GPU has fallen off the bus",
	92:  "high single-bit ECC error rate",
	94:  "contained ECC error",
	95:  "uncontained ECC error",
	109: "context switch timeout error",
	119: "GSP RPC timeout",
	120: "GSP error",
}

// XIDDescription names an XID ("XID 79: GPU has fallen off the bus").
func XIDDescription(code int) string {
	if t, ok := xidText[code]; ok {
		return fmt.Sprintf("XID %d: %s", code, t)
	}
	return fmt.Sprintf("XID %d", code)
}
