package contracts

import (
	"strings"
	"testing"
	"time"
)

func TestFaultValidate(t *testing.T) {
	for name, f := range map[string]Fault{
		"xid 79 by default":       {ID: "f1", Kind: FaultXID},
		"xid 48 on GPU 3":         {ID: "f2", Kind: FaultXID, GPU: "3", Code: 48},
		"ecc by UUID":             {ID: "f3", Kind: FaultECCDBE, GPU: "GPU-2ebef7c3-f8c7-5df5-a911-eb95dc540dc8"},
		"overheat for a minute":   {ID: "f4", Kind: FaultOverheat, Duration: Duration(time.Minute)},
		"pause":                   {ID: "f5", Kind: FaultAgentPause, Duration: Duration(1500 * time.Millisecond)},
		"death":                   {ID: "f6", Kind: FaultMachineDeath},
		"clear the whole machine": {ID: "f7", Kind: FaultClear},
	} {
		if err := f.Validate(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	for name, c := range map[string]struct {
		f    Fault
		want []string
	}{
		"no ID":             {Fault{Kind: FaultXID}, []string{"fault ID is empty"}},
		"unknown kind":      {Fault{ID: "x", Kind: "meteor"}, []string{`fault kind "meteor"`}},
		"negative code":     {Fault{ID: "x", Kind: FaultXID, Code: -1}, []string{"fault code -1"}},
		"code on ecc":       {Fault{ID: "x", Kind: FaultECCDBE, Code: 48}, []string{"for kind xid only"}},
		"negative duration": {Fault{ID: "x", Kind: FaultOverheat, Duration: Duration(-time.Second)}, []string{"fault duration -1s"}},
		"duration on xid":   {Fault{ID: "x", Kind: FaultXID, Duration: Duration(time.Second)}, []string{"for kinds overheat and agent_pause"}},
		"everything wrong":  {Fault{Kind: "?", Code: 1 << 20, GPU: strings.Repeat("9", 100)}, []string{"ID is empty", "kind", "code", "GPU"}},
	} {
		err := c.f.Validate()
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not say %q", name, err, w)
			}
		}
	}
	if got := (Fault{Kind: FaultXID}).XIDCode(); got != 79 {
		t.Errorf("default XID %d, want 79", got)
	}
	if got := (Fault{Kind: FaultAgentPause}).PauseDuration(); got != 30*time.Second {
		t.Errorf("default pause %s, want 30s", got)
	}
}

func TestXIDUnhealthy(t *testing.T) {
	for code, unhealthy := range map[int]bool{
		79: true, 48: true, 94: true, 95: true, 63: true, 64: true, 74: true, 92: true, 119: true, 120: true,
		13: false, 31: false, 43: false, 45: false, 68: false, 109: false,
	} {
		if got := XIDUnhealthy(code); got != unhealthy {
			t.Errorf("XIDUnhealthy(%d) = %v, want %v", code, got, unhealthy)
		}
	}
}
