module github.com/gpuplane/gpuplane/services/billing

go 1.26.0

require (
	github.com/gpuplane/gpuplane/contracts v0.0.0
	github.com/gpuplane/gpuplane/libs v0.0.0
)

replace (
	github.com/gpuplane/gpuplane/contracts => ../../contracts
	github.com/gpuplane/gpuplane/libs => ../../libs
)
