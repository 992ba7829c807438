package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/santhosh-tekuri/jsonschema/v6"

	"github.com/gpuplane/gpuplane/contracts/openapi"
)

// Every response the gateway's tests receive through the harness's client
// (startGateway) is checked against the OpenAPI document the gateway
// serves (contracts/openapi): its status must be one the operation
// declares, its Content-Type one that status declares, a JSON body valid
// against its schema (kin-openapi's openapi3filter, JSON Schema 2020-12),
// each server-sent event's data a valid JobEvent named by its type; a
// path that is no route must be 404, a method a path does not list 405
// with the Allow header the document implies. A mismatch fails the test
// that produced it. TestMain reports which (operation, status) pairs the
// package's tests exercised.

// apiSpec is the document, loaded once for the package.
var apiSpec = sync.OnceValues(func() (*specIndex, error) {
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(openapi.Gateway)
	if err != nil {
		return nil, fmt.Errorf("load the OpenAPI document: %w", err)
	}
	if err := doc.Validate(loader.Context); err != nil {
		return nil, fmt.Errorf("the OpenAPI document is not valid: %w", err)
	}
	raw, err := jsonschema.UnmarshalJSON(bytes.NewReader(openapi.Gateway))
	if err != nil {
		return nil, err
	}
	ix := newSpecIndex(doc)
	ix.compiler = jsonschema.NewCompiler()
	ix.compiler.DefaultDraft(jsonschema.Draft2020)
	ix.compiler.AssertFormat()
	if err := ix.compiler.AddResource(docURL, raw); err != nil {
		return nil, err
	}
	return ix, nil
})

// docURL names the document for the schema compiler.
const docURL = "https://gpuplane.dev/openapi/gateway.openapi.json"

// schemaAt returns the schema at a JSON pointer of the document, compiled
// on first use.
func (ix *specIndex) schemaAt(pointer string) (*jsonschema.Schema, error) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if sch, ok := ix.compiled[pointer]; ok {
		return sch, nil
	}
	sch, err := ix.compiler.Compile(docURL + "#" + pointer)
	if err != nil {
		return nil, fmt.Errorf("compile %s: %w", pointer, err)
	}
	if ix.compiled == nil {
		ix.compiled = map[string]*jsonschema.Schema{}
	}
	ix.compiled[pointer] = sch
	return sch, nil
}

// validJSON checks a JSON document against the schema at pointer.
func (ix *specIndex) validJSON(pointer string, data []byte) error {
	sch, err := ix.schemaAt(pointer)
	if err != nil {
		return err
	}
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
	if err != nil {
		return fmt.Errorf("not JSON: %w", err)
	}
	return sch.Validate(v)
}

// mediaPointer is the JSON pointer of a media type's schema below an
// operation: the response of a status, or the request body (status 0).
func mediaPointer(op specOp, status int, mediaType string) string {
	esc := func(s string) string { return strings.ReplaceAll(strings.ReplaceAll(s, "~", "~0"), "/", "~1") }
	at := "/paths/" + esc(op.path) + "/" + strings.ToLower(op.method)
	if status == 0 {
		return at + "/requestBody/content/" + esc(mediaType) + "/schema"
	}
	return at + "/responses/" + strconv.Itoa(status) + "/content/" + esc(mediaType) + "/schema"
}

// specIndex finds a request's operation the way the gateway routes it: a
// ServeMux with the document's paths, per method and once more without
// one (the 405 answer).
type specIndex struct {
	doc *openapi3.T
	// compiler holds the raw document; schemas are compiled from it once
	// each, by JSON pointer (kin-openapi's JSON Schema 2020-12 validation
	// compiles the schema anew on every call, which doubled the
	// package's test time).
	compiler *jsonschema.Compiler
	mu       sync.Mutex
	compiled map[string]*jsonschema.Schema
	mux      *http.ServeMux
	// ops is each operation by "METHOD path" as the document writes it.
	ops map[string]specOp
	// allow is the Allow header each path's 405 must carry.
	allow map[string]string
}

type specOp struct {
	method, path string
	item         *openapi3.PathItem
	op           *openapi3.Operation
}

// muxPattern is a document path as ServeMux writes it: "/" is the console
// alone, not every path.
func muxPattern(path string) string {
	if path == "/" {
		return "/{$}"
	}
	return path
}

func newSpecIndex(doc *openapi3.T) *specIndex {
	ix := &specIndex{doc: doc, mux: http.NewServeMux(), ops: map[string]specOp{}, allow: map[string]string{}}
	noop := func(http.ResponseWriter, *http.Request) {}
	for path, item := range doc.Paths.Map() {
		methods := slices.Sorted(maps.Keys(item.Operations()))
		for _, m := range methods {
			ix.ops[m+" "+path] = specOp{method: m, path: path, item: item, op: item.GetOperation(m)}
			ix.mux.HandleFunc(m+" "+muxPattern(path), noop)
		}
		ix.mux.HandleFunc(muxPattern(path), noop)
		if slices.Contains(methods, http.MethodGet) {
			methods = append(methods, http.MethodHead)
		}
		ix.allow[path] = strings.Join(methods, ", ")
	}
	return ix
}

// match returns the operation of r ("METHOD path" as documented), or the
// documented path whose other methods r asks for (405), or neither (404).
func (ix *specIndex) match(r *http.Request) (op specOp, methodNotAllowed string, found bool) {
	_, pattern := ix.mux.Handler(r)
	if pattern == "" {
		return specOp{}, "", false
	}
	method, path, hasMethod := strings.Cut(pattern, " ")
	if !hasMethod {
		path = method
	}
	if path == "/{$}" {
		path = "/"
	}
	if !hasMethod {
		return specOp{}, path, false
	}
	return ix.ops[method+" "+path], "", true
}

// exercised counts each (operation, status) the package's tests saw.
var exercised = struct {
	sync.Mutex
	n map[string]map[int]int
}{n: map[string]map[int]int{}}

func markExercised(key string, status int) {
	exercised.Lock()
	defer exercised.Unlock()
	if exercised.n[key] == nil {
		exercised.n[key] = map[int]int{}
	}
	exercised.n[key][status]++
}

// openapiCheck is the validating transport.
type openapiCheck struct {
	base http.RoundTripper
	ix   *specIndex

	mu       sync.Mutex
	failures []string
	// closed is set once the failures were reported: a stream frame read
	// after its test ended is not reported to a finished test.
	closed bool
	// canned is set by the checker's own test, whose made-up responses
	// are not the gateway's and stay out of the exercised report.
	canned bool
}

func (c *openapiCheck) exercised(key string, status int) {
	if !c.canned {
		markExercised(key, status)
	}
}

// checkOpenAPI wraps the harness's transport so that every response is
// checked; what does not match fails h's test when it ends.
func (h *harness) checkOpenAPI(base http.RoundTripper) http.RoundTripper {
	h.t.Helper()
	ix, err := apiSpec()
	if err != nil {
		h.t.Fatal(err)
	}
	c := &openapiCheck{base: base, ix: ix}
	h.t.Cleanup(func() {
		for _, f := range c.report() {
			h.t.Errorf("OpenAPI mismatch: %s", f)
		}
	})
	return c
}

func (c *openapiCheck) fail(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.closed {
		c.failures = append(c.failures, fmt.Sprintf(format, args...))
	}
}

// report returns the failures so far and drops any later one.
func (c *openapiCheck) report() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	return c.failures
}

func (c *openapiCheck) RoundTrip(r *http.Request) (*http.Response, error) {
	res, err := c.base.RoundTrip(r)
	if err != nil {
		return res, err
	}
	c.check(r, res)
	return res, nil
}

// check checks one response; a body it reads is put back for the test.
func (c *openapiCheck) check(r *http.Request, res *http.Response) {
	what := fmt.Sprintf("%s %s: %d", r.Method, r.URL.RequestURI(), res.StatusCode)
	// Outside the operations, an unauthenticated request is refused
	// before routing (401), as it is while the identities load (503).
	refused := res.StatusCode == http.StatusUnauthorized || res.StatusCode == http.StatusServiceUnavailable
	op, otherMethods, found := c.ix.match(r)
	switch {
	case cleanPath(r.URL.Path) != r.URL.Path:
		// ServeMux redirects a path with // or /./ to its clean form.
		c.exercised("(unclean path)", res.StatusCode)
		redirect := res.StatusCode == http.StatusMovedPermanently || res.StatusCode == http.StatusTemporaryRedirect ||
			res.StatusCode == http.StatusPermanentRedirect
		if !redirect && !refused || redirect && res.Header.Get("Location") == "" {
			c.fail("%s: an unclean path must be redirected to %s (Location), or refused 401", what, cleanPath(r.URL.Path))
		}
		return
	case otherMethods != "":
		c.exercised("(other methods) "+otherMethods, res.StatusCode)
		if res.StatusCode != http.StatusMethodNotAllowed && !refused {
			c.fail("%s: the document has no %s on %s, so the gateway must answer 405", what, r.Method, otherMethods)
		}
		if got, want := res.Header.Get("Allow"), c.ix.allow[otherMethods]; res.StatusCode == http.StatusMethodNotAllowed && got != want {
			c.fail("%s: Allow %q, but the document's methods of %s make %q", what, got, otherMethods, want)
		}
		c.checkError(what, res)
		return
	case !found:
		c.exercised("(no route)", res.StatusCode)
		if res.StatusCode != http.StatusNotFound && !refused {
			c.fail("%s: the document has no such path, so the gateway must answer 404", what)
		}
		c.checkError(what, res)
		return
	}
	key := op.method + " " + op.path
	c.exercised(key, res.StatusCode)
	resp := op.op.Responses.Status(res.StatusCode)
	if resp == nil || resp.Value == nil {
		c.fail("%s: status %d is not declared for %s (declared: %v)", what, res.StatusCode, key, declared(op.op))
		return
	}
	ct := res.Header.Get("Content-Type")
	content := resp.Value.Content
	if len(content) > 0 && r.Method != http.MethodHead && content.Get(ct) == nil {
		c.fail("%s: Content-Type %q is not declared for %s %d (declared: %v)", what, ct, key, res.StatusCode,
			slices.Sorted(maps.Keys(content)))
		return
	}
	if res.StatusCode/100 == 2 {
		c.checkRequest(what, op, r)
	}
	mt, _, _ := strings.Cut(ct, ";")
	switch {
	case r.Method == http.MethodHead:
		// No body; the status is all there is to check.
	case mt == "application/json":
		body, err := io.ReadAll(res.Body)
		res.Body.Close()
		res.Body = io.NopCloser(bytes.NewReader(body))
		if err != nil {
			return // the test sees the same error
		}
		c.validate(what, op, res, body)
	case mt == "text/event-stream":
		res.Body = &sseCheck{ReadCloser: res.Body, c: c, what: what, ix: c.ix, key: key}
	}
}

// validate runs openapi3filter's response validation: the declared
// headers and the body against its schema.
func (c *openapiCheck) validate(what string, op specOp, res *http.Response, body []byte) {
	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{
			Request: res.Request,
			Route:   &routers.Route{Spec: c.ix.doc, Path: op.path, PathItem: op.item, Method: op.method, Operation: op.op},
		},
		Status:  res.StatusCode,
		Header:  res.Header,
		Options: &openapi3filter.Options{IncludeResponseStatus: true, ExcludeResponseBody: true, MultiError: true},
	}
	in.SetBodyBytes(body)
	if res.Request == nil { // a response made up by a test of this checker
		in.RequestValidationInput.Request = &http.Request{Method: op.method}
	}
	if err := openapi3filter.ValidateResponse(context.Background(), in); err != nil {
		c.fail("%s: %v", what, err)
	}
	if err := c.ix.validJSON(mediaPointer(op, res.StatusCode, "application/json"), body); err != nil {
		c.fail("%s: the body doesn't match its schema: %v; body %s", what, err, truncate(body, 600))
	}
}

// checkRequest holds a request the gateway accepted to the document: its
// parameters and body must be ones the operation declares, or the
// document refuses what the gateway takes.
func (c *openapiCheck) checkRequest(what string, op specOp, r *http.Request) {
	req := r.Clone(context.Background())
	req.Body = http.NoBody
	if r.GetBody != nil {
		body, err := r.GetBody()
		if err != nil {
			return
		}
		req.Body = body
		if req.Header.Get("Content-Type") == "" && r.ContentLength != 0 {
			req.Header.Set("Content-Type", "application/json") // what the gateway reads a body as
		}
	}
	in := &openapi3filter.RequestValidationInput{
		Request:    req,
		PathParams: docPathValues(op.path, r.URL.Path),
		Route:      &routers.Route{Spec: c.ix.doc, Path: op.path, PathItem: op.item, Method: op.method, Operation: op.op},
		Options: &openapi3filter.Options{AuthenticationFunc: openapi3filter.NoopAuthenticationFunc, MultiError: true,
			ExcludeRequestBody: true},
	}
	if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil {
		c.fail("%s: the gateway accepted a request the document refuses: %v", what, err)
	}
	if op.op.RequestBody == nil || r.GetBody == nil {
		return
	}
	body, err := io.ReadAll(req.Body)
	switch {
	case err != nil:
	case len(body) == 0 && op.op.RequestBody.Value.Required:
		c.fail("%s: the gateway accepted no body, which the document requires", what)
	case len(body) > 0:
		if err := c.ix.validJSON(mediaPointer(op, 0, "application/json"), body); err != nil {
			c.fail("%s: the gateway accepted a request the document refuses: its body: %v; body %s", what, err, truncate(body, 600))
		}
	}
}

// docPathValues reads the {name} segments of a documented path from a
// request path.
func docPathValues(pattern, p string) map[string]string {
	vals := map[string]string{}
	want, got := strings.Split(pattern, "/"), strings.Split(p, "/")
	for i, seg := range want {
		if name, ok := strings.CutPrefix(seg, "{"); ok && i < len(got) {
			vals[strings.TrimSuffix(name, "}")] = got[i]
		}
	}
	return vals
}

// cleanPath is ServeMux's canonical form of a path: path.Clean, keeping
// a trailing slash.
func cleanPath(p string) string {
	if p == "" {
		return "/"
	}
	np := path.Clean(p)
	if strings.HasSuffix(p, "/") && np != "/" {
		np += "/"
	}
	return np
}

// checkError checks an answer outside every operation: an APIError body.
func (c *openapiCheck) checkError(what string, res *http.Response) {
	body, err := io.ReadAll(res.Body)
	res.Body.Close()
	res.Body = io.NopCloser(bytes.NewReader(body))
	if err != nil {
		return
	}
	if ct := res.Header.Get("Content-Type"); ct != "application/json" {
		c.fail("%s: Content-Type %q, want application/json (an APIError)", what, ct)
	} else if err := c.ix.validJSON("/components/schemas/APIError", body); err != nil {
		c.fail("%s: body is not an APIError: %v; body %s", what, err, truncate(body, 600))
	}
}

func declared(op *openapi3.Operation) []string {
	return slices.Sorted(maps.Keys(op.Responses.Map()))
}

func truncate(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "..."
	}
	return string(b)
}

// sseCheck checks each server-sent event as the test reads it: comments
// pass; an event has an event name, a numeric id and data that is a
// JobEvent (the document's x-sse dataSchema) of that type.
type sseCheck struct {
	io.ReadCloser
	c         *openapiCheck
	ix        *specIndex
	what, key string
	buf       []byte
}

func (s *sseCheck) Read(p []byte) (int, error) {
	n, err := s.ReadCloser.Read(p)
	s.buf = append(s.buf, p[:n]...)
	for {
		i := bytes.Index(s.buf, []byte("\n\n"))
		if i < 0 {
			break
		}
		s.frame(string(s.buf[:i]))
		s.buf = s.buf[i+2:]
	}
	return n, err
}

func (s *sseCheck) frame(f string) {
	var event, id, data string
	for line := range strings.SplitSeq(f, "\n") {
		name, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch name {
		case "": // a comment
		case "event":
			event = value
		case "id":
			id = value
		case "data":
			data += value
		default:
			s.c.fail("%s: stream line %q is no server-sent event field", s.what, line)
		}
	}
	if event == "" && id == "" && data == "" {
		return
	}
	s.c.exercised(s.key, -1) // -1: an event frame
	if _, err := strconv.ParseUint(id, 10, 64); err != nil {
		s.c.fail("%s: event id %q is not a stream sequence", s.what, id)
	}
	var v any
	if err := json.Unmarshal([]byte(data), &v); err != nil {
		s.c.fail("%s: event data is not JSON: %v", s.what, err)
		return
	}
	pointer := s.ix.eventSchema(s.key)
	if pointer == "" {
		s.c.fail("%s: the document names no x-sse dataSchema for %s", s.what, s.key)
		return
	}
	if err := s.ix.validJSON(pointer, []byte(data)); err != nil {
		s.c.fail("%s: event data does not match its schema: %v; data %s", s.what, err, truncate([]byte(data), 600))
	}
	m, _ := v.(map[string]any)
	switch {
	case pointer == "/components/schemas/QueueList": // GET /v1/queues/events: the whole list, one event name
		if event != "queues" {
			s.c.fail("%s: a QueueList under event %q, want queues", s.what, event)
		}
	case m["type"] != event:
		s.c.fail("%s: event %q carries a JobEvent of type %v", s.what, event, m["type"])
	}
}

// eventSchema is the JSON pointer of the schema the x-sse extension of an
// operation's 200 text/event-stream names; "" when none.
func (ix *specIndex) eventSchema(key string) string {
	op := ix.ops[key]
	mt := op.op.Responses.Status(http.StatusOK).Value.Content.Get("text/event-stream")
	if mt == nil {
		return ""
	}
	x, _ := mt.Extensions["x-sse"].(map[string]any)
	ref, _ := x["dataSchema"].(string)
	name, ok := strings.CutPrefix(ref, "#/components/schemas/")
	if !ok || ix.doc.Components.Schemas[name] == nil {
		return ""
	}
	return "/components/schemas/" + name
}

// TestMain runs the package's tests, then reports the (operation, status)
// pairs they exercised and the declared ones they did not (shown with -v,
// or written to $GATEWAY_OPENAPI_REPORT). When the whole package ran and
// passed, every documented operation must have had its success answer
// checked: a route added to the document without a test of it fails.
func TestMain(m *testing.M) {
	code := m.Run()
	if report := exercisedReport(); report != "" {
		fmt.Print(report)
		if f := os.Getenv("GATEWAY_OPENAPI_REPORT"); f != "" {
			_ = os.WriteFile(f, []byte(report), 0o644)
		}
		whole := flag.Lookup("test.run").Value.String() == "" && flag.Lookup("test.skip").Value.String() == ""
		if missing := untestedSuccesses(); code == 0 && whole && !testing.Short() && len(missing) > 0 {
			fmt.Printf("FAIL: no test of this package got the success answer of %s, so the OpenAPI check never saw it\n",
				strings.Join(missing, ", "))
			code = 1
		}
	}
	os.Exit(code)
}

// untestedSuccesses lists the operations whose 2xx answer no test saw.
func untestedSuccesses() []string {
	ix, err := apiSpec()
	if err != nil {
		return nil
	}
	exercised.Lock()
	defer exercised.Unlock()
	var out []string
	for _, key := range slices.Sorted(maps.Keys(ix.ops)) {
		if !slices.ContainsFunc(slices.Collect(maps.Keys(exercised.n[key])), func(st int) bool { return st/100 == 2 }) {
			out = append(out, key)
		}
	}
	return out
}

func exercisedReport() string {
	ix, err := apiSpec()
	exercised.Lock()
	defer exercised.Unlock()
	if err != nil || len(exercised.n) == 0 {
		return ""
	}
	var b strings.Builder
	pairs, missing := 0, 0
	fmt.Fprintln(&b, "OpenAPI responses exercised by these tests (status×count; events: server-sent event frames):")
	for _, key := range slices.Sorted(maps.Keys(ix.ops)) {
		seen := exercised.n[key]
		var got, not []string
		for _, st := range slices.Sorted(maps.Keys(seen)) {
			if st == -1 {
				got = append(got, fmt.Sprintf("events×%d", seen[st]))
				continue
			}
			got = append(got, fmt.Sprintf("%d×%d", st, seen[st]))
			pairs++
		}
		for _, st := range declared(ix.ops[key].op) {
			n, _ := strconv.Atoi(st)
			if seen[n] == 0 {
				not = append(not, st)
				missing++
			}
		}
		fmt.Fprintf(&b, "  %-52s %s", key, strings.Join(got, " "))
		if len(not) > 0 {
			fmt.Fprintf(&b, "   (not exercised: %s)", strings.Join(not, " "))
		}
		fmt.Fprintln(&b)
	}
	for _, key := range slices.Sorted(maps.Keys(exercised.n)) {
		if _, ok := ix.ops[key]; !ok {
			var got []string
			for _, st := range slices.Sorted(maps.Keys(exercised.n[key])) {
				got = append(got, fmt.Sprintf("%d×%d", st, exercised.n[key][st]))
			}
			fmt.Fprintf(&b, "  %-52s %s\n", key, strings.Join(got, " "))
		}
	}
	fmt.Fprintf(&b, "OpenAPI: %d (operation, status) pairs exercised over %d operations; %d declared pairs not exercised\n",
		pairs, len(ix.ops), missing)
	return b.String()
}
