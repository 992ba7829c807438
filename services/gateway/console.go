package gateway

import (
	_ "embed"
	"html/template"
	"net/http"

	"github.com/gpuplane/gpuplane/contracts"
)

// consoleHTML is the web console: one self-contained page (no external
// assets; gpuplane may run where there is no internet) that polls the list
// endpoint and posts the submit form as JSON.
//
//go:embed console.html
var consoleHTML string

var consoleTemplate = template.Must(template.New("console").Parse(consoleHTML))

type consoleData struct {
	Models     []string
	Priorities []contracts.Priority
	Any        string
}

func (s *server) console(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Content-Type-Options", "nosniff")
	// Everything is inline and same-origin; forbid the rest.
	h.Set("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; frame-ancestors 'none'")
	if err := consoleTemplate.Execute(w, consoleData{Models: contracts.GPUModels, Priorities: contracts.Priorities, Any: contracts.GPUModelAny}); err != nil {
		s.log.Warn("console render", "err", err)
	}
}
