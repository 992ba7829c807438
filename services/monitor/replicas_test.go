package monitor_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
	"github.com/gpuplane/gpuplane/libs/natsserver/natstest"
	"github.com/gpuplane/gpuplane/services/monitor"
)

// TestReplicasServeMetricsAndOneAlerts runs two monitor replicas on one
// alerting lease: both serve the node's series, a node's silence is
// alerted once, by the lease holder, and when the holder stops the other
// takes over and resolves that very episode (same episode number: its
// engine ran on the same samples while it stood by).
func TestReplicasServeMetricsAndOneAlerts(t *testing.T) {
	srv := natstest.Start(t)
	b := connect(t, srv)
	const silentAfter = 800 * time.Millisecond
	replica := func(name string) monitor.Config {
		cfg := monitor.DefaultConfig()
		cfg.SilentAfter = silentAfter
		cfg.Instance = name
		cfg.LeaseTTL = 300 * time.Millisecond
		return cfg
	}
	addrA, stopA := startMonitorWith(t, srv, replica("monitor-a"))
	waitHealthy(t, addrA)
	eventually(t, 10*time.Second, "monitor-a holding the alerting lease", func() bool {
		return strings.HasPrefix(monitorLeaseHolder(t, b), "monitor-a-")
	}, func() string { return monitorLeaseHolder(t, b) })
	addrB, _ := startMonitorWith(t, srv, replica("monitor-b"))
	waitHealthy(t, addrB)

	tick(t, b, "n2", "host-2")
	publish(t, b, contracts.SubjectTelemetry("n1"), "n1-once", telemetry("n1", "host-1", "h100", gpu(0, "GPU-1a", "H100-80GB", 50)))
	for _, addr := range []string{addrA, addrB} {
		eventually(t, 10*time.Second, "n2's series on "+addr, func() bool {
			return strings.Contains(strings.Join(scrape(t, addr), "\n"), `DCGM_FI_DEV_GPU_UTIL{Hostname="host-2"`)
		}, func() string { return "" })
	}
	eventually(t, 10*time.Second, "node_silent firing for n1", func() bool {
		return len(readAlerts(t, b, "node_silent")) >= 1
	}, func() string { return "" })
	// JetStream would hide the standby's copy under the same message ID:
	// shorten its memory, then let both replicas check several times.
	natstest.ForgetMsgIDs(t, b.JetStream(), contracts.StreamOps)
	time.Sleep(5 * silentAfter)

	stopA()
	eventually(t, 10*time.Second, "monitor-b holding the alerting lease", func() bool {
		return strings.HasPrefix(monitorLeaseHolder(t, b), "monitor-b-")
	}, func() string { return monitorLeaseHolder(t, b) })
	tick(t, b, "n1", "host-1")
	eventually(t, 10*time.Second, "node_silent resolved for n1", func() bool {
		return len(readAlerts(t, b, "node_silent")) >= 2
	}, func() string { return "" })

	var got []string
	_, err := b.Replay(context.Background(), bus.FollowSpec{Stream: contracts.StreamOps,
		FilterSubjects: []string{contracts.SubjectAlert("node_silent")}}, func(_ context.Context, m *bus.Msg) error {
		got = append(got, m.ID()+" by "+m.Header.Get(contracts.HeaderCESource))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"alert/node_silent/n1/1/firing by /gpuplane/monitor-a", "alert/node_silent/n1/1/resolved by /gpuplane/monitor-b"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("node_silent alerts (-want +got):\n%s", diff)
	}
}

// monitorLeaseHolder is the holder of the alerting lease while it is
// current, "" otherwise.
func monitorLeaseHolder(t *testing.T, b *bus.Bus) string {
	t.Helper()
	kv, err := b.KeyValue(context.Background(), contracts.BucketLeases)
	if err != nil {
		t.Fatal(err)
	}
	e, err := kv.Get(context.Background(), contracts.LeaseKeyMonitor)
	if err != nil {
		return fmt.Sprint(err)
	}
	var l contracts.Lease
	if err := json.Unmarshal(e.Value(), &l); err != nil || time.Now().After(l.Expires) {
		return ""
	}
	return l.Holder
}
