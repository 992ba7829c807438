package gateway

import (
	"net/http"

	"github.com/gpuplane/gpuplane/contracts/openapi"
)

// openapiDoc answers GET /v1/openapi.json: the OpenAPI 3.1 description of
// this API (contracts/openapi), open to everyone like /healthz, so that a
// client generator or a person can read it before having a token.
// TestRoutesDocumented keeps it and handler's routes the same.
func (s *server) openapiDoc(w http.ResponseWriter, _ *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-cache")
	_, _ = w.Write(openapi.Gateway) // the client may be gone; nothing to do about it
}
