package scheduler

import (
	"flag"
	"strings"
	"testing"
	"time"
)

func TestConfigDefaultsAreValid(t *testing.T) {
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
	if c.Name != "scheduler" || c.CycleInterval != 5*time.Millisecond || c.DemandInterval != time.Second {
		t.Fatalf("defaults %+v", c)
	}
}

func TestConfigValidateReportsEveryProblem(t *testing.T) {
	c := DefaultConfig()
	c.Bus.NATSURL = ""
	c.Name = "bad.name"
	c.CycleInterval = 0
	c.DemandInterval = -time.Second
	c.Publishers = 0
	c.MaxPlanBytes = 1 << 20
	c.RememberEnded = time.Hour // a late commit must still find its job
	err := c.Validate()
	if err == nil {
		t.Fatal("Validate accepted a broken config")
	}
	for _, want := range []string{"nats URL", "name", "cycle interval", "demand interval", "publishers", "max plan bytes", "remember ended"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

func TestConfigFlags(t *testing.T) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("scheduler", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"-name", "sched-2", "-cycle-interval", "20ms", "-nats", "nats://n:4222", "-publishers", "4",
		"-remember-ended", "72h"}); err != nil {
		t.Fatal(err)
	}
	if c.Name != "sched-2" || c.CycleInterval != 20*time.Millisecond || c.Bus.NATSURL != "nats://n:4222" || c.Publishers != 4 ||
		c.RememberEnded != 72*time.Hour {
		t.Fatalf("flags not applied: %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	c.RememberEnded = 0 // for ever
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
}
