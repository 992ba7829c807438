package contracts

import (
	"fmt"
	"slices"
	"strings"
)

// maxFaultXID is the largest XID a fault request may name (XIDs are
// 16-bit codes).
const maxFaultXID = 1<<16 - 1

// DecodeFaultRequest decodes a fault request (POST /v1/nodes/{node}/faults)
// strictly, as its published schema says, and checks what can be checked
// without the node: every problem at once, each on its field. The GPU is
// checked against the node's inventory by the gateway.
func DecodeFaultRequest(data []byte) (FaultRequest, error) {
	var req FaultRequest
	if err := decodeValidated(data, &req, req.validate); err != nil {
		return FaultRequest{}, err
	}
	return req, nil
}

func (req *FaultRequest) validate() error {
	var errs []FieldError
	add := func(field string, reason Reason, format string, args ...any) {
		errs = append(errs, FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	kinds := make([]string, len(FaultKinds))
	for i, k := range FaultKinds {
		kinds[i] = string(k)
	}
	switch {
	case req.Kind == "":
		add("kind", ReasonMissingField, "kind is required; want one of %s", strings.Join(kinds, ", "))
	case !slices.Contains(FaultKinds, req.Kind):
		add("kind", ReasonInvalidValue, "unknown fault kind %q; want one of %s", req.Kind, strings.Join(kinds, ", "))
	}
	machineWide := req.Kind == FaultMachineDeath || req.Kind == FaultAgentPause
	if req.GPU != "" && machineWide {
		add("gpu", ReasonInvalidValue, "%s concerns the whole machine; leave gpu empty", req.Kind)
	}
	switch {
	case req.Code != 0 && req.Kind != FaultXID:
		add("code", ReasonInvalidValue, "code applies only to kind xid")
	case req.Code < 0 || req.Code > maxFaultXID:
		add("code", ReasonOutOfRange, "XID %d; want 1 to %d (0 or none: %d, fell off the bus)", req.Code, maxFaultXID, DefaultFaultXID)
	}
	switch d := req.Duration; {
	case d == 0:
	case d < 0:
		add("duration", ReasonInvalidDuration, "duration %s is negative", d.D())
	case req.Kind != FaultOverheat && req.Kind != FaultAgentPause:
		add("duration", ReasonInvalidValue, "duration applies only to overheat and agent_pause")
	case d.D() > MaxFaultDuration:
		add("duration", ReasonOutOfRange, "duration %s; want at most %s", d.D(), MaxFaultDuration)
	}
	return newValidationError(errs)
}
