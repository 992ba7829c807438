// Package metrics exposes the monitor's read model to Prometheus. The
// Collector computes every series from a snapshot at scrape time, so there
// is no second copy of the state to keep in sync.
//
// GPU series use dcgm-exporter's names, units and labels (gpu, UUID,
// pci_bus_id, device, modelName, Hostname) plus pool, so dashboards built
// for dcgm-exporter work unchanged. Platform series are prefixed gpuplane_.
package metrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/monitor/internal/readmodel"
	"github.com/gpuplane/gpuplane/services/monitor/internal/rules"
)

// Source is what the collector reads: the read model.
type Source interface {
	Snapshot(freshSince time.Time) readmodel.Snapshot
}

var _ Source = (*readmodel.Model)(nil)

// Windows is what the collector reads of the rules engine: the rolling
// utilisation per machine, pool and tenant and the open alert episodes.
type Windows interface {
	Utilisation(now, freshSince time.Time, scope rules.Scope) []rules.Aggregate
	Firing() map[string]int
}

var _ Windows = (*rules.Engine)(nil)

// gpuLabels are dcgm-exporter's labels, in its order, and pool. device is
// the GPU's device file name (nvidia<index>); pci_bus_id comes from the
// node's inventory, "" until it arrives.
var gpuLabels = []string{"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "pool"}

// dcgm lists the dcgm-exporter gauges and the sample field each reads.
// Types follow dcgm-exporter's default counters file: ECC totals are
// counters, the rest gauges.
var dcgm = []struct {
	desc  *prometheus.Desc
	typ   prometheus.ValueType
	value func(contracts.GPUSample) float64
}{
	{prometheus.NewDesc("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return s.GPUUtil }},
	{prometheus.NewDesc("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return s.MemCopyUtil }},
	{prometheus.NewDesc("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return float64(s.FBUsedMiB) }},
	{prometheus.NewDesc("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return float64(s.FBFreeMiB) }},
	{prometheus.NewDesc("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return s.TempC }},
	{prometheus.NewDesc("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return s.PowerW }},
	{prometheus.NewDesc("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return s.SMClockMHz }},
	{prometheus.NewDesc("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return s.PowerLimitW }},
	{prometheus.NewDesc("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", gpuLabels, nil), prometheus.CounterValue,
		func(s contracts.GPUSample) float64 { return float64(s.ECCSBE) }},
	{prometheus.NewDesc("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", gpuLabels, nil), prometheus.CounterValue,
		func(s contracts.GPUSample) float64 { return float64(s.ECCDBE) }},
	{prometheus.NewDesc("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Current clock throttle reasons (bit mask).", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return float64(s.ThrottleReasons) }},
	{prometheus.NewDesc("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", gpuLabels, nil), prometheus.GaugeValue,
		func(s contracts.GPUSample) float64 { return float64(s.LastXID) }},
}

var (
	jobsDesc = prometheus.NewDesc("gpuplane_jobs",
		"Jobs by state and tenant, folded from JOB_EVENTS.", []string{"state", "tenant"}, nil)
	queueDepthDesc = prometheus.NewDesc("gpuplane_queue_depth",
		"Jobs of a tenant waiting in the queue.", []string{"tenant"}, nil)
	allocatedDesc = prometheus.NewDesc("gpuplane_allocated_gpus",
		"GPUs of a pool held by committed allocations.", []string{"pool"}, nil)
	tenantAllocatedDesc = prometheus.NewDesc("gpuplane_tenant_allocated_gpus",
		"GPUs of a pool held by a tenant's committed allocations.", []string{"pool", "tenant"}, nil)
	// A gauge: no _total, which names counters.
	gpusDesc = prometheus.NewDesc("gpuplane_gpus",
		"GPUs of a pool's live nodes (lost nodes excluded).", []string{"pool"}, nil)
	nodesDesc = prometheus.NewDesc("gpuplane_nodes",
		"Live nodes of a pool (lost nodes excluded).", []string{"pool"}, nil)
	telemetryDesc = prometheus.NewDesc("gpuplane_telemetry_messages_total",
		"Telemetry messages received since the monitor started.", nil, nil)
	pendingJobsDesc = prometheus.NewDesc("gpuplane_pool_pending_jobs",
		"Jobs waiting for a pool, as the scheduler last published (gp.sched.demand).", []string{"pool"}, nil)
	pendingGPUsDesc = prometheus.NewDesc("gpuplane_pool_pending_gpus",
		"GPUs the jobs waiting for a pool ask for, as the scheduler last published.", []string{"pool"}, nil)
	freeGPUsDesc = prometheus.NewDesc("gpuplane_pool_free_gpus",
		"Free GPUs of a pool, as the scheduler last published.", []string{"pool"}, nil)
	allocRatioDesc = prometheus.NewDesc("gpuplane_pool_allocation_ratio",
		"Allocated GPUs over the GPUs of a pool's live nodes (0 to 1; absent when the pool has none).", []string{"pool"}, nil)
	poolUtilDesc = prometheus.NewDesc("gpuplane_pool_gpu_util_1m",
		"Mean GPU utilization (in %) of a pool's GPUs over the last minute.", []string{"pool"}, nil)
	nodeUtilDesc = prometheus.NewDesc("gpuplane_node_gpu_util_1m",
		"Mean GPU utilization (in %) of a machine's GPUs over the last minute.", []string{"node", "Hostname", "pool"}, nil)
	tenantUtilDesc = prometheus.NewDesc("gpuplane_tenant_gpu_util_1m",
		"Mean GPU utilization (in %) of the GPUs a tenant's allocations hold, over the last minute.", []string{"tenant"}, nil)
	queueDesc = prometheus.NewDesc("gpuplane_pool_queue_depth",
		"Queued jobs by the pool they ask for (\"\" for any) and the scheduler's pending reason (none: not yet given).",
		[]string{"pool", "reason"}, nil)
	fragmentationDesc = prometheus.NewDesc("gpuplane_pool_fragmentation_ratio",
		"Share of a pool's free GPU capacity (milli-GPU) that is not on fully idle healthy machines: "+
			"1 - free_on_idle_machines/free_total, 0 when nothing is free.", []string{"pool"}, nil)
	freeMilliDesc = prometheus.NewDesc("gpuplane_pool_free_milligpus",
		"Free capacity of a pool's healthy GPUs on live nodes, in thousandths of a GPU, from inventory and ledger.", []string{"pool"}, nil)
	idleMilliDesc = prometheus.NewDesc("gpuplane_pool_idle_free_milligpus",
		"The part of gpuplane_pool_free_milligpus on fully idle healthy machines.", []string{"pool"}, nil)
	requeuesDesc = prometheus.NewDesc("gpuplane_job_requeues_total",
		"Jobs requeued, by the pool they ran on and reason, once per job attempt.", []string{"pool", "reason"}, nil)
	preemptionsDesc = prometheus.NewDesc("gpuplane_preemptions_total",
		"Jobs requeued because they were preempted, by the pool they ran on, once per job attempt.", []string{"pool"}, nil)
	migrationsDesc = prometheus.NewDesc("gpuplane_job_migrations_total",
		"Job moves, by pool moved from, reason and event (migrating: started; migrated: running on new devices).",
		[]string{"pool", "reason", "event"}, nil)
	scaleDesc = prometheus.NewDesc("gpuplane_scale_decisions_total",
		"Autoscaler decisions by pool and direction, once per decision ID.", []string{"pool", "direction"}, nil)
	machineEventsDesc = prometheus.NewDesc("gpuplane_machine_events_total",
		"Autoscaler machine events by pool and kind, once per machine and kind.", []string{"pool", "kind"}, nil)
	heartbeatAgeDesc = prometheus.NewDesc("gpuplane_node_heartbeat_age_seconds",
		"Seconds since a node's agent last sent a heartbeat (every 2 s by default; 3 missed make the node lost), "+
			"for nodes heard from and not since deleted or reclaimed.", []string{"node", "pool"}, nil)
	telemetryAgeDesc = prometheus.NewDesc("gpuplane_node_telemetry_age_seconds",
		"Seconds since a node last sent telemetry (every second by default), for nodes heard from and not since "+
			"deleted or reclaimed: a machine that left on purpose is gone, not silent.", []string{"node", "Hostname", "pool"}, nil)
	alertsFiringDesc = prometheus.NewDesc("gpuplane_alerts_firing",
		"Open alert episodes of each rule.", []string{"kind"}, nil)
)

// Collector is a prometheus.Collector over a Source.
type Collector struct {
	src        Source
	win        Windows
	now        func() time.Time
	staleAfter time.Duration
}

var _ prometheus.Collector = (*Collector)(nil)

// New returns a collector reading src and, when not nil, win. GPUs of
// nodes silent for staleAfter or longer are not exposed; now is the clock.
func New(src Source, win Windows, staleAfter time.Duration, now func() time.Time) *Collector {
	if now == nil {
		now = time.Now
	}
	return &Collector{src: src, win: win, now: now, staleAfter: staleAfter}
}

// Describe sends every descriptor the collector can emit.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range dcgm {
		ch <- d.desc
	}
	for _, d := range []*prometheus.Desc{jobsDesc, queueDepthDesc, allocatedDesc, tenantAllocatedDesc,
		gpusDesc, nodesDesc, telemetryDesc, pendingJobsDesc, pendingGPUsDesc, freeGPUsDesc, allocRatioDesc,
		poolUtilDesc, nodeUtilDesc, tenantUtilDesc, alertsFiringDesc, queueDesc, fragmentationDesc, freeMilliDesc,
		idleMilliDesc, requeuesDesc, preemptionsDesc, migrationsDesc, scaleDesc, machineEventsDesc, heartbeatAgeDesc,
		telemetryAgeDesc} {
		ch <- d
	}
}

// Collect computes every series from one snapshot of the source.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	now := c.now()
	s := c.src.Snapshot(now.Add(-c.staleAfter))
	for _, g := range s.GPUs {
		idx := strconv.Itoa(g.Sample.Index)
		labels := []string{idx, g.Sample.UUID, g.PCIBusID, "nvidia" + idx, g.Sample.Model, g.Hostname, g.Pool}
		for _, d := range dcgm {
			ch <- prometheus.MustNewConstMetric(d.desc, d.typ, d.value(g.Sample), labels...)
		}
	}
	queued := map[string]int{}
	for _, j := range s.Jobs {
		ch <- prometheus.MustNewConstMetric(jobsDesc, prometheus.GaugeValue, float64(j.Jobs), string(j.State), j.Tenant)
		if _, ok := queued[j.Tenant]; !ok {
			queued[j.Tenant] = 0
		}
		if j.State == contracts.StateQueued {
			queued[j.Tenant] += j.Jobs
		}
	}
	for tenant, n := range queued {
		ch <- prometheus.MustNewConstMetric(queueDepthDesc, prometheus.GaugeValue, float64(n), tenant)
	}
	for _, p := range s.Pools {
		ch <- prometheus.MustNewConstMetric(allocatedDesc, prometheus.GaugeValue, float64(p.AllocatedGPUs), p.Pool)
		ch <- prometheus.MustNewConstMetric(gpusDesc, prometheus.GaugeValue, float64(p.GPUs), p.Pool)
		ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(p.Nodes), p.Pool)
		if p.GPUs > 0 {
			ch <- prometheus.MustNewConstMetric(allocRatioDesc, prometheus.GaugeValue, float64(p.AllocatedGPUs)/float64(p.GPUs), p.Pool)
		}
	}
	for _, d := range s.Demand {
		ch <- prometheus.MustNewConstMetric(pendingJobsDesc, prometheus.GaugeValue, float64(d.PendingJobs), d.Pool)
		ch <- prometheus.MustNewConstMetric(pendingGPUsDesc, prometheus.GaugeValue, float64(d.PendingGPUs), d.Pool)
		ch <- prometheus.MustNewConstMetric(freeGPUsDesc, prometheus.GaugeValue, float64(d.FreeGPUs), d.Pool)
	}
	for _, a := range s.TenantAllocations {
		ch <- prometheus.MustNewConstMetric(tenantAllocatedDesc, prometheus.GaugeValue, float64(a.GPUs), a.Pool, a.Tenant)
	}
	ch <- prometheus.MustNewConstMetric(telemetryDesc, prometheus.CounterValue, float64(s.TelemetryMessages))
	collectPlatform(ch, s)
	for _, h := range s.Heartbeats {
		ch <- prometheus.MustNewConstMetric(heartbeatAgeDesc, prometheus.GaugeValue, h.Age(now).Seconds(), h.Node, h.Pool)
	}
	for _, n := range s.Telemetry {
		ch <- prometheus.MustNewConstMetric(telemetryAgeDesc, prometheus.GaugeValue, n.Age(now).Seconds(), n.Node, n.Hostname, n.Pool)
	}
	if c.win == nil {
		return
	}
	for _, a := range c.win.Utilisation(now, now.Add(-c.staleAfter), rules.ScopePool) {
		ch <- prometheus.MustNewConstMetric(poolUtilDesc, prometheus.GaugeValue, a.Mean, a.Key)
	}
	for _, a := range c.win.Utilisation(now, now.Add(-c.staleAfter), rules.ScopeNode) {
		ch <- prometheus.MustNewConstMetric(nodeUtilDesc, prometheus.GaugeValue, a.Mean, a.Key, a.Labels["hostname"], a.Labels["pool"])
	}
	for _, a := range c.win.Utilisation(now, now.Add(-c.staleAfter), rules.ScopeTenant) {
		ch <- prometheus.MustNewConstMetric(tenantUtilDesc, prometheus.GaugeValue, a.Mean, a.Key)
	}
	for kind, n := range c.win.Firing() {
		ch <- prometheus.MustNewConstMetric(alertsFiringDesc, prometheus.GaugeValue, float64(n), kind)
	}
}

// collectPlatform emits the queue, capacity and event counter series.
func collectPlatform(ch chan<- prometheus.Metric, s readmodel.Snapshot) {
	for _, q := range s.Queue {
		ch <- prometheus.MustNewConstMetric(queueDesc, prometheus.GaugeValue, float64(q.Jobs), q.Pool, q.Reason)
	}
	for _, c := range s.Capacity {
		ch <- prometheus.MustNewConstMetric(fragmentationDesc, prometheus.GaugeValue, c.Fragmentation(), c.Pool)
		ch <- prometheus.MustNewConstMetric(freeMilliDesc, prometheus.GaugeValue, float64(c.FreeMilli), c.Pool)
		ch <- prometheus.MustNewConstMetric(idleMilliDesc, prometheus.GaugeValue, float64(c.IdleMilli), c.Pool)
	}
	preempted := map[string]uint64{}
	for _, r := range s.Counters.Requeues {
		ch <- prometheus.MustNewConstMetric(requeuesDesc, prometheus.CounterValue, float64(r.N), r.Pool, r.Label)
		if _, ok := preempted[r.Pool]; !ok {
			preempted[r.Pool] = 0
		}
		if r.Label == string(contracts.ReasonPreempted) {
			preempted[r.Pool] += r.N
		}
	}
	for pool, n := range preempted {
		ch <- prometheus.MustNewConstMetric(preemptionsDesc, prometheus.CounterValue, float64(n), pool)
	}
	for _, m := range s.Counters.Moves {
		ch <- prometheus.MustNewConstMetric(migrationsDesc, prometheus.CounterValue, float64(m.N), m.Pool, m.Reason, string(m.Event))
	}
	for _, d := range s.Counters.ScaleDecisions {
		ch <- prometheus.MustNewConstMetric(scaleDesc, prometheus.CounterValue, float64(d.N), d.Pool, d.Label)
	}
	for _, e := range s.Counters.MachineEvents {
		ch <- prometheus.MustNewConstMetric(machineEventsDesc, prometheus.CounterValue, float64(e.N), e.Pool, e.Label)
	}
}
