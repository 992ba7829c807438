// Package metrics exposes the monitor's read model to Prometheus. The
// Collector computes every series from a snapshot at scrape time, so there
// is no second copy of the state to keep in sync.
//
// GPU series use dcgm-exporter's names, units and labels (gpu, UUID,
// modelName, Hostname) plus pool, so dashboards built for dcgm-exporter work
// unchanged. Platform series are prefixed gpuplane_.
package metrics

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/monitor/internal/readmodel"
)

// Source is what the collector reads: the read model.
type Source interface {
	Snapshot(freshSince time.Time) readmodel.Snapshot
}

var _ Source = (*readmodel.Model)(nil)

var gpuLabels = []string{"gpu", "UUID", "modelName", "Hostname", "pool"}

// dcgm lists the dcgm-exporter gauges and the sample field each reads.
var dcgm = []struct {
	desc  *prometheus.Desc
	value func(contracts.GPUSample) float64
}{
	{prometheus.NewDesc("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", gpuLabels, nil),
		func(s contracts.GPUSample) float64 { return s.GPUUtil }},
	{prometheus.NewDesc("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", gpuLabels, nil),
		func(s contracts.GPUSample) float64 { return s.MemCopyUtil }},
	{prometheus.NewDesc("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", gpuLabels, nil),
		func(s contracts.GPUSample) float64 { return float64(s.FBUsedMiB) }},
	{prometheus.NewDesc("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", gpuLabels, nil),
		func(s contracts.GPUSample) float64 { return float64(s.FBFreeMiB) }},
	{prometheus.NewDesc("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", gpuLabels, nil),
		func(s contracts.GPUSample) float64 { return s.TempC }},
	{prometheus.NewDesc("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", gpuLabels, nil),
		func(s contracts.GPUSample) float64 { return s.PowerW }},
	{prometheus.NewDesc("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", gpuLabels, nil),
		func(s contracts.GPUSample) float64 { return s.SMClockMHz }},
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
	gpusTotalDesc = prometheus.NewDesc("gpuplane_gpus_total",
		"GPUs of a pool's live nodes (lost nodes excluded).", []string{"pool"}, nil)
	nodesDesc = prometheus.NewDesc("gpuplane_nodes",
		"Live nodes of a pool (lost nodes excluded).", []string{"pool"}, nil)
	telemetryDesc = prometheus.NewDesc("gpuplane_telemetry_messages_total",
		"Telemetry messages received since the monitor started.", nil, nil)
)

// Collector is a prometheus.Collector over a Source.
type Collector struct {
	src        Source
	now        func() time.Time
	staleAfter time.Duration
}

var _ prometheus.Collector = (*Collector)(nil)

// New returns a collector reading src. GPUs of nodes silent for staleAfter
// or longer are not exposed; now is the clock.
func New(src Source, staleAfter time.Duration, now func() time.Time) *Collector {
	if now == nil {
		now = time.Now
	}
	return &Collector{src: src, now: now, staleAfter: staleAfter}
}

// Describe sends every descriptor the collector can emit.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range dcgm {
		ch <- d.desc
	}
	for _, d := range []*prometheus.Desc{jobsDesc, queueDepthDesc, allocatedDesc, tenantAllocatedDesc,
		gpusTotalDesc, nodesDesc, telemetryDesc} {
		ch <- d
	}
}

// Collect computes every series from one snapshot of the source.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.src.Snapshot(c.now().Add(-c.staleAfter))
	for _, g := range s.GPUs {
		labels := []string{strconv.Itoa(g.Sample.Index), g.Sample.UUID, g.Sample.Model, g.Hostname, g.Pool}
		for _, d := range dcgm {
			ch <- prometheus.MustNewConstMetric(d.desc, prometheus.GaugeValue, d.value(g.Sample), labels...)
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
		ch <- prometheus.MustNewConstMetric(gpusTotalDesc, prometheus.GaugeValue, float64(p.GPUs), p.Pool)
		ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(p.Nodes), p.Pool)
	}
	for _, a := range s.TenantAllocations {
		ch <- prometheus.MustNewConstMetric(tenantAllocatedDesc, prometheus.GaugeValue, float64(a.GPUs), a.Pool, a.Tenant)
	}
	ch <- prometheus.MustNewConstMetric(telemetryDesc, prometheus.CounterValue, float64(s.TelemetryMessages))
}
