// Package device holds what every GPU backend of the node agent (simulated
// or NVML) reports about its machine, so the backends and the agent share
// one vocabulary without importing each other.
package device

import "github.com/gpuplane/gpuplane/contracts"

// Machine is what discovery finds on a machine.
type Machine struct {
	GPUs []contracts.GPUInfo
	// DriverVersion and CUDAVersion are the NVIDIA driver's version and the
	// CUDA version it supports.
	DriverVersion string
	CUDAVersion   string
	// Topology links every pair of GPUs (by index), A < B.
	Topology []contracts.GPULink
}

// Health is one health fact a backend observed on one GPU. The agent adds
// node, incarnation, sequence and time, and publishes it.
type Health struct {
	GPUIndex int
	GPUUUID  string
	Kind     contracts.HealthKind
	Code     int
	Healthy  bool
	Message  string
}
