// Package gpuplane is the Go client of gpuplane's REST API, the gateway:
// submit, inspect, list, cancel and watch jobs, read their output, and read
// or edit what the platform's administrators manage (nodes and their holds,
// quotas, pools, the price book, budgets, API tokens, role bindings, the
// audit trail). gpuctl makes every one of its HTTP calls through it.
//
// Import it as
//
//	import "github.com/gpuplane/gpuplane/sdk/go/gpuplane"
//
// The request and response bodies are the types of the contracts module
// (github.com/gpuplane/gpuplane/contracts), held to the JSON Schemas of
// contracts/schema.
//
// # Calls
//
// Every call takes a context first, and returns an error that is an
// *APIError when the gateway answered (or the client refused to send) a
// request: it carries the HTTP status, the stable reason code of the
// gateway's error body and its field errors. errors.As finds it; IsNotFound,
// IsForbidden and the other helpers test the common cases.
//
// # Authentication
//
// The client sends a bearer token from a TokenSource: a StaticToken (an API
// token, gpt_...), the login gpuctl stored (StoredLogin), or
// DefaultTokenSource, which reads GPUPLANE_TOKEN and falls back to the
// stored login as gpuctl does. WithCACertFile trusts a private CA.
//
// # Retries
//
// A call is sent again, with exponential backoff and jitter, only where
// that is safe: a 429 (the gateway refused it before acting, after its
// Retry-After) for every call; a connection error or a 5xx for idempotent
// calls only: reads, a submit (whose job ID makes a repeat the same job:
// Submit sets one when the request has none), a cancel, a hold, a delete,
// and a PUT without a revision precondition. A checkpoint, a fault, a
// login, or a token creation is never repeated.
//
// # Streams
//
// Watch follows a job's events over server-sent events until the job ends,
// resuming with Last-Event-ID after a broken connection, so no event is lost
// or repeated. Logs reads (or follows) a run's output; what is known only at
// its end (complete, exit code, missing ranges) comes with the stream.
package gpuplane
