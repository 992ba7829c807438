package gpuctl

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strings"
)

// EnvTraceParent is the environment variable a caller (a CI job, a
// script already in a trace) sets to put gpuctl's requests in its trace,
// as OpenTelemetry's environment-carrier convention names it.
const EnvTraceParent = "TRACEPARENT"

// traceIDOf is the trace ID of a W3C traceparent, "" when tp is not one.
func traceIDOf(tp string) string {
	parts := strings.Split(tp, "-")
	if len(parts) != 4 || parts[0] != "00" || len(parts[1]) != 32 || len(parts[2]) != 16 || len(parts[3]) != 2 {
		return ""
	}
	if _, err := hex.DecodeString(parts[1] + parts[2] + parts[3]); err != nil || strings.Trim(parts[1], "0") == "" {
		return ""
	}
	return strings.ToLower(parts[1])
}

// newTraceID is the trace of one gpuctl command: the caller's from
// TRACEPARENT, else a new random one, so that every request of the
// command (a submit, then following its events) is one trace in Jaeger
// with the gateway's and the platform's spans under it.
func newTraceID(inherited string) string {
	if id := traceIDOf(inherited); id != "" {
		return id
	}
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// setTraceParent writes traceparent on req: the command's trace, a new
// span ID per request (gpuctl records no spans of its own: each request
// is a child of the caller's span, sampled).
func setTraceParent(req *http.Request, traceID string) {
	if traceID == "" {
		return
	}
	var span [8]byte
	_, _ = rand.Read(span[:])
	req.Header.Set("traceparent", "00-"+traceID+"-"+hex.EncodeToString(span[:])+"-01")
}
