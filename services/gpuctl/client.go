package gpuctl

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// requestTimeout bounds one non-streaming call to the gateway.
const requestTimeout = 30 * time.Second

// apiError is a gateway answer outside 2xx, or a request refused before
// sending (Status 0) presented the same way.
type apiError struct {
	Status int
	Body   contracts.APIErrorBody
}

func (e *apiError) Error() string {
	switch {
	case e.Status == 0: // found before sending anything
		return fmt.Sprintf("%s: %s", e.Body.Reason, e.Body.Message)
	case e.Body.Reason == "":
		return fmt.Sprintf("HTTP %d: %s", e.Status, e.Body.Message)
	}
	return fmt.Sprintf("%s: %s (HTTP %d)", e.Body.Reason, e.Body.Message, e.Status)
}

// client calls the gateway's REST API, with the caller's bearer token.
type client struct {
	base  string
	hc    *http.Client
	token string
	// err is a problem found while building the client (an unreadable CA
	// file), reported by the first call.
	err error
	// traceID is the W3C trace every request carries (trace.go).
	traceID string
}

func newClient(base string) *client {
	return &client{base: strings.TrimRight(base, "/"), hc: &http.Client{}}
}

// tenantPath is /v1/tenants/<tenant> followed by the escaped elements.
func tenantPath(tenant string, elems ...string) string {
	p := "/v1/tenants/" + url.PathEscape(tenant)
	for _, e := range elems {
		p += "/" + url.PathEscape(e)
	}
	return p
}

// call sends one request; a 2xx JSON answer is decoded into out, any other
// answer comes back as an *apiError.
func (c *client) call(ctx context.Context, method, path string, query url.Values, body []byte, out any) error {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	res, err := c.send(ctx, method, path, query, body, nil)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	data, err := io.ReadAll(io.LimitReader(res.Body, 64<<20))
	if err != nil {
		return fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if res.StatusCode/100 != 2 {
		return answerError(res.StatusCode, data)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("%s %s: decoding the answer: %w", method, path, err)
		}
	}
	return nil
}

// newClient is a client of the gateway with the caller's credentials:
// GPUPLANE_TOKEN, else the token `gpuctl login` stored for this gateway.
func (a *app) newClient() *client {
	c := newClient(a.gateway)
	c.traceID = newTraceID(a.traceParent)
	c.token = a.token
	if c.token == "" && a.configDir != "" {
		if creds, err := LoadCredentials(a.configDir); err == nil {
			c.token = creds.Gateways[normalizeGateway(a.gateway)].Token
		}
	}
	if a.caCert != "" {
		c.hc, c.err = tlsClient(a.caCert)
	}
	return c
}

// tlsClient trusts the CA in caFile and speaks TLS 1.3 only, as the
// gateway does.
func tlsClient(caFile string) (*http.Client, error) {
	pemData, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("--ca-cert: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemData) {
		return nil, fmt.Errorf("--ca-cert %s: no PEM certificate", caFile)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13}
	return &http.Client{Transport: tr}, nil
}

func (c *client) send(ctx context.Context, method, path string, query url.Values, body []byte, header http.Header) (*http.Response, error) {
	if c.err != nil {
		return nil, c.err
	}
	u := c.base + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	// A 429 (the tenant's request rate) is answered before the gateway
	// acts, so sending the same request again after Retry-After is safe.
	for attempt := 1; ; attempt++ {
		res, err := c.sendOnce(ctx, method, u, body, header)
		if err != nil || res.StatusCode != http.StatusTooManyRequests || attempt == maxRateLimitedTries {
			return res, err
		}
		wait, perr := strconv.Atoi(res.Header.Get("Retry-After"))
		if perr != nil || wait < 1 {
			wait = 1
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 1<<16))
		res.Body.Close()
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("gateway %s: rate limited, and %w while waiting %ds to retry", c.base, ctx.Err(), wait)
		case <-time.After(time.Duration(wait) * time.Second):
		}
	}
}

// maxRateLimitedTries bounds how often a request answered 429 is sent.
const maxRateLimitedTries = 4

func (c *client) sendOnce(ctx context.Context, method, u string, body []byte, header http.Header) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return nil, fmt.Errorf("gateway request: %w", err)
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if req.Header.Get("Accept") == "" {
		req.Header.Set("Accept", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	setTraceParent(req, c.traceID)
	res, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("gateway %s unreachable: %w", c.base, err)
	}
	return res, nil
}

// answerError turns an error answer into an *apiError, whether or not its
// body is the gateway's APIError (a proxy may answer instead).
func answerError(status int, data []byte) error {
	var ae contracts.APIError
	if err := json.Unmarshal(data, &ae); err == nil && ae.Error.Reason != "" {
		return &apiError{Status: status, Body: ae.Error}
	}
	msg := strings.TrimSpace(string(data))
	if len(msg) > 200 {
		msg = msg[:200] + "..."
	}
	if msg == "" {
		msg = http.StatusText(status)
	}
	return &apiError{Status: status, Body: contracts.APIErrorBody{Message: msg}}
}
