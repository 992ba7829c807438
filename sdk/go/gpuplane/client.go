package gpuplane

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
)

// DefaultRequestTimeout bounds a call that is not a stream, retries included.
const DefaultRequestTimeout = 30 * time.Second

// maxAnswer bounds the JSON answer read (an invoice of a busy tenant is
// the largest).
const maxAnswer = 64 << 20

// Client calls one gateway. It is safe for concurrent use.
type Client struct {
	base    string
	hc      *http.Client
	tokens  TokenSource
	retry   RetryPolicy
	timeout time.Duration
	edit    func(*http.Request)
	// sleep waits between attempts; tests keep the real one.
	sleep func(ctx context.Context, d time.Duration) error
}

// Option configures a Client.
type Option func(*Client) error

// New is a client of the gateway at baseURL (http://127.0.0.1:8080,
// https://gpuplane.example.com). Without WithToken or WithTokenSource it
// sends no credentials: only the open endpoints (health, login) answer.
func New(baseURL string, opts ...Option) (*Client, error) {
	u, err := url.Parse(baseURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("gateway URL %q: want http(s)://host[:port]", baseURL)
	}
	c := &Client{base: strings.TrimRight(baseURL, "/"), hc: &http.Client{}, retry: DefaultRetry,
		timeout: DefaultRequestTimeout, sleep: sleepCtx}
	for _, o := range opts {
		if err := o(c); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// BaseURL is the gateway's URL, without a trailing slash.
func (c *Client) BaseURL() string { return c.base }

// HTTPClient is the http.Client the client sends with (its TLS settings
// included), for other calls to the same parties (an OIDC provider).
func (c *Client) HTTPClient() *http.Client { return c.hc }

// WithToken sends token (an API token, a session token from Login, an
// OIDC ID token) as the bearer token.
func WithToken(token string) Option {
	return WithTokenSource(StaticToken(token))
}

// WithTokenSource asks ts for the bearer token of every request.
func WithTokenSource(ts TokenSource) Option {
	return func(c *Client) error { c.tokens = ts; return nil }
}

// WithHTTPClient sends with hc (its transport, proxy and TLS settings).
// It replaces what WithTLSConfig or WithCACertFile set before it.
func WithHTTPClient(hc *http.Client) Option {
	return func(c *Client) error {
		if hc == nil {
			return errors.New("WithHTTPClient: nil client")
		}
		c.hc = hc
		return nil
	}
}

// WithTLSConfig speaks TLS with cfg (a private CA, a client certificate).
func WithTLSConfig(cfg *tls.Config) Option {
	return func(c *Client) error {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = cfg
		c.hc = &http.Client{Transport: tr}
		return nil
	}
}

// WithCACertFile trusts the CA certificates in the PEM file path (the CA
// that signed the gateway's certificate) and speaks TLS 1.3 only, as the
// gateway does.
func WithCACertFile(path string) Option {
	return func(c *Client) error {
		pemData, err := os.ReadFile(path)
		if err != nil {
			return fmt.Errorf("CA certificate: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pemData) {
			return fmt.Errorf("CA certificate %s: no PEM certificate", path)
		}
		return WithTLSConfig(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13})(c)
	}
}

// WithRetry replaces DefaultRetry; NoRetry sends every request once.
func WithRetry(p RetryPolicy) Option {
	return func(c *Client) error { c.retry = p; return nil }
}

// WithRequestTimeout bounds a call that is not a stream, its retries
// included (default DefaultRequestTimeout; 0: only the context bounds
// it). Watch and Logs are bounded by their context alone.
func WithRequestTimeout(d time.Duration) Option {
	return func(c *Client) error { c.timeout = d; return nil }
}

// WithRequestEditor calls edit on every request before it is sent, each
// attempt (gpuctl sets a W3C traceparent there).
func WithRequestEditor(edit func(*http.Request)) Option {
	return func(c *Client) error { c.edit = edit; return nil }
}

// RetryPolicy says how often a call is sent and how long to wait between
// attempts: BaseDelay doubled at each attempt, at most MaxDelay, less a
// random part of up to half (so clients that failed together do not
// retry together). A 429's or 503's Retry-After is waited out in full.
type RetryPolicy struct {
	// MaxAttempts counts the first; 1 (or less) never retries.
	MaxAttempts int
	BaseDelay   time.Duration
	MaxDelay    time.Duration
}

// DefaultRetry is four attempts over about two seconds of backoff.
var DefaultRetry = RetryPolicy{MaxAttempts: 4, BaseDelay: 250 * time.Millisecond, MaxDelay: 5 * time.Second}

// NoRetry sends every request once.
var NoRetry = RetryPolicy{MaxAttempts: 1}

// delay is the backoff before attempt n+1 (n from 1).
func (p RetryPolicy) delay(n int) time.Duration {
	d := p.BaseDelay << min(n-1, 20)
	if p.MaxDelay > 0 && (d > p.MaxDelay || d <= 0) {
		d = p.MaxDelay
	}
	if d <= 0 {
		return 0
	}
	return d/2 + rand.N(d/2+1)
}

// request is one call.
type request struct {
	method string
	path   string
	query  url.Values
	body   []byte
	header http.Header
	// idempotent: sending it again after a connection error or a 5xx
	// cannot do the thing twice.
	idempotent bool
	// stream: the answer is read for as long as it lasts (no timeout).
	stream bool
}

// call sends r and decodes a 2xx JSON answer into out (nil: ignored).
func (c *Client) call(ctx context.Context, r request, out any) error {
	if c.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	res, err := c.do(ctx, r)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	data, err := io.ReadAll(io.LimitReader(res.Body, maxAnswer))
	if err != nil {
		return fmt.Errorf("%s %s: reading the answer: %w", r.method, r.path, err)
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("%s %s: decoding the answer: %w", r.method, r.path, err)
		}
	}
	return nil
}

// do sends r, retrying as its idempotence and the policy allow, and
// returns a 2xx answer with its body unread; any other answer is an
// *APIError.
func (c *Client) do(ctx context.Context, r request) (*http.Response, error) {
	u := c.base + r.path
	if len(r.query) > 0 {
		u += "?" + r.query.Encode()
	}
	for attempt := 1; ; attempt++ {
		res, err := c.send(ctx, r, u)
		if err == nil && res.StatusCode/100 == 2 {
			return res, nil
		}
		var wait time.Duration
		if err == nil {
			data, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
			res.Body.Close()
			err = answerError(res.StatusCode, data)
			wait = retryAfter(res.Header.Get("Retry-After"))
		}
		if attempt >= c.retry.MaxAttempts || !c.retryable(r, err) || ctx.Err() != nil {
			return nil, err
		}
		if wait == 0 {
			wait = c.retry.delay(attempt)
		}
		if serr := c.sleep(ctx, wait); serr != nil {
			return nil, fmt.Errorf("%w (and %w while waiting %s to retry)", err, serr, wait)
		}
	}
}

// retryable reports whether r may be sent again after err: a 429 was
// refused before the gateway acted, so always; a connection error or a
// 5xx may have acted, so only when doing it twice is doing it once.
func (c *Client) retryable(r request, err error) bool {
	ae, ok := errors.AsType[*APIError](err)
	switch {
	case ok && ae.StatusCode == http.StatusTooManyRequests:
		return true
	case !r.idempotent:
		return false
	case ok:
		return ae.StatusCode >= 500 && ae.StatusCode != http.StatusNotImplemented
	}
	// A transport error (refused, reset, cut mid-answer); not our own
	// refusal to send, which the same request would meet again.
	return !errors.Is(err, errNotSent)
}

// errNotSent marks a request never sent (no token, a bad request).
var errNotSent = errors.New("request not sent")

func (c *Client) send(ctx context.Context, r request, u string) (*http.Response, error) {
	var body io.Reader
	if r.body != nil {
		body = bytes.NewReader(r.body)
	}
	req, err := http.NewRequestWithContext(ctx, r.method, u, body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNotSent, err)
	}
	for k, vs := range r.header {
		req.Header[k] = vs
	}
	if r.body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if req.Header.Get("Accept") == "" {
		req.Header.Set("Accept", "application/json")
	}
	if c.tokens != nil {
		tok, err := c.tokens.Token(ctx)
		if err != nil {
			return nil, fmt.Errorf("%w: credentials: %w", errNotSent, err)
		}
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
	}
	if c.edit != nil {
		c.edit(req)
	}
	res, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("gateway %s unreachable: %w", c.base, err)
	}
	return res, nil
}

// retryAfter reads a Retry-After of whole seconds; 0 when absent.
func retryAfter(v string) time.Duration {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 1 {
		return 0
	}
	return time.Duration(min(n, 3600)) * time.Second
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// path joins escaped path elements: path("v1", "tenants", t, "jobs").
func path(elems ...string) string {
	var b strings.Builder
	for _, e := range elems {
		b.WriteByte('/')
		b.WriteString(url.PathEscape(e))
	}
	return b.String()
}

// tenantPath is /v1/tenants/<tenant>/<elems...>, escaped.
func tenantPath(tenant string, elems ...string) string {
	return path(append([]string{"v1", "tenants", tenant}, elems...)...)
}

// jsonBody marshals v; a json.RawMessage or []byte is sent as it is.
func jsonBody(v any) ([]byte, error) {
	switch b := v.(type) {
	case json.RawMessage:
		return b, nil
	case []byte:
		return b, nil
	}
	data, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("%w: encoding the body: %w", errNotSent, err)
	}
	return data, nil
}
