package gpuctl

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
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

// client calls the gateway's REST API.
type client struct {
	base string
	hc   *http.Client
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

func (c *client) send(ctx context.Context, method, path string, query url.Values, body []byte, header http.Header) (*http.Response, error) {
	u := c.base + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
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
	req.Header.Set("Accept", "application/json")
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
