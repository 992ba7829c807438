package gpuctl

import (
	"net/http"

	"github.com/gpuplane/gpuplane/sdk/go/gpuplane"
)

// api is a client of the gateway (the public Go client, package
// gpuplane) with the caller's credentials: GPUPLANE_TOKEN, else the token
// `gpuctl login` stored for this gateway; --ca-cert's CA; and the
// command's trace on every request (trace.go). An unreadable CA file is
// its error.
func (a *app) api() (*gpuplane.Client, error) {
	token := a.token
	if token == "" && a.configDir != "" {
		if creds, err := LoadCredentials(a.configDir); err == nil {
			token = creds.Gateways[normalizeGateway(a.gateway)].Token
		}
	}
	if a.traceID == "" {
		a.traceID = newTraceID(a.traceParent)
	}
	traceID := a.traceID
	opts := []gpuplane.Option{gpuplane.WithToken(token),
		gpuplane.WithRequestEditor(func(r *http.Request) { setTraceParent(r, traceID) })}
	if a.caCert != "" {
		opts = append(opts, gpuplane.WithCACertFile(a.caCert))
	}
	return gpuplane.New(a.gateway, opts...)
}
