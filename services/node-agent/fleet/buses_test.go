package fleet

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
)

// Buses are a fleet test's connections to a NATS server of its own, one
// per identity, so the fleet under test runs with the permissions
// contracts.Access gives a simulated fleet and no more.
type Buses struct {
	// Op is the operator's: it provisions the streams (in memory), sends
	// commands and faults, and observes.
	Op *bus.Bus
	// Fleet is the simulated fleet's own, what the code under test uses.
	Fleet *bus.Bus
	// RM is the resource manager's: ledger entries come from it (agents
	// refuse any other's).
	RM *bus.Bus
}

// ConnectBuses starts a server for t and connects the three buses to it;
// they are closed when t ends. (Exported for the fleet_test package.)
func ConnectBuses(t testing.TB) Buses {
	t.Helper()
	srv := natstest.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	log := slog.New(slog.NewTextHandler(t.Output(), nil))
	connect := func(name, creds string, provision bool) *bus.Bus {
		b, err := bus.Connect(ctx, bus.Config{URL: srv.URL(), Name: name, CredsFile: creds, Logger: log,
			Streams: contracts.StreamOptions{Memory: true}, SkipProvision: !provision})
		if err != nil {
			t.Fatalf("connect %s: %v", name, err)
		}
		t.Cleanup(func() { _ = b.Close(context.Background()) })
		return b
	}
	return Buses{
		Op: connect("fleet-test", natstest.Operator(t, srv), true),
		Fleet: connect("fleet-sim", natstest.Creds(t, srv, contracts.Identity{Name: "fleet", Role: contracts.BusFleet}),
			false),
		RM: connect("resource-manager", natstest.Service(t, srv, contracts.BusResourceManager), false),
	}
}
