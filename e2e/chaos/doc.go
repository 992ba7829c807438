// Package chaos is gpuplane's chaos suite (issue 13): the production
// topology run as processes on one machine, faults injected from a seed,
// and the invariants checked from the outside.
//
// Topology: three nats-server processes clustered on loopback (built from
// the nats-server version e2e/go.mod pins), JetStream with
// sync_interval: always, operator-mode auth minted with libs/natsauth as
// gpuplane-creds does, every stream at R3; redis-server for billing; every
// service as its own process with its own bus identity and replicas (two
// schedulers on one lease, two of billing, monitor and the gateway, the
// resource manager and autoscaler doubled once they take a lease), and two
// fleet-sim processes of 8-GPU machines. Every link of NATS node 2 (its
// client port and each route to and from it) passes through a Proxy the
// suite can cut: a network partition on loopback without iptables.
//
// Workload: steady arrivals of simulated runs, gangs over two machines,
// checkpointing runs and real commands, through both gateways and the
// bus, one in twenty cancelled. A warm-up without faults comes first, then
// the fault phase: one fault at a time, SIGKILL and SIGSTOP of a replica
// of every service and of a NATS node, the partition of node 2, Redis
// killed (it has no persistence: it comes back empty) and flushed.
//
// Checks, after a drain: every job ended (succeeded, or cancelled when the
// suite cancelled it; nothing stuck, nothing lost), the e2e oracle (G1: no
// GPU given twice; J1: no job run twice; metering), billing equal to the
// agents' run facts run by run (oracle.CheckBillingMatchesRuns), a tenant's
// quota never exceeded, and no run stopped (machine lost, agent restarted)
// while the last fault was a NATS node's. Each is a violation; the test
// fails on any.
//
// Figures: seed, jobs, faults by kind, violations, recovery per service
// (fault -> its first useful output: the scheduler's next scheduled
// event, the resource manager's next ledger commit, billing's next usage
// record, a fleet's next heartbeat, a NATS node's, gateway's or
// monitor's first healthy /healthz), and submit -> scheduled percentiles
// without and with faults. The recovery bound (recoveryBound, 12 s after
// the fault ends) is the longest lease, the resource manager's 10 s, plus
// 2 s to start and rebuild (the scheduler's lease is 3 s, the heartbeat
// timeout 6 s); a recovery or scheduling gap past it is listed in the
// report.
//
// Tiers: `make test` runs the small tier (seed 13, 15 s warm-up, 60 s of
// faults, 8 machines); `make chaos` the full one (GPUPLANE_CHAOS_FULL=1:
// random seed, printed; CHAOS_DURATION of faults, default 4m; 40 machines).
// GPUPLANE_CHAOS_SEED replays a seed (the faults and workload it draws;
// the timing of a loaded machine is not replayed). CHAOS_SRC=<dir> builds
// the services from another checkout (git archive of an older commit), for
// before/after figures with one suite and one seed. Without redis-server
// the suite skips, unless GPUPLANE_REQUIRE_REDIS=1.
package chaos
