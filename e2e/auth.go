package e2e

import (
	"net/http"
	"net/url"
	"sync"
)

// The gateway authenticates every request but /healthz. The e2e tests
// call it as a platform admin: each gateway they start registers its
// admin token here under its host:port, and authClient sends it on every
// request to that gateway (and to nothing else).

// gatewayTokens maps a gateway's host:port to its admin token.
var gatewayTokens sync.Map

// authorize makes authClient send token to the gateway at gatewayURL.
func authorize(gatewayURL, token string) {
	u, err := url.Parse(gatewayURL)
	if err != nil || u.Host == "" {
		u = &url.URL{Host: gatewayURL}
	}
	gatewayTokens.Store(u.Host, token)
}

// authClient is http.DefaultClient with the gateway's token.
var authClient = &http.Client{Transport: authTransport{}}

type authTransport struct{}

func (authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if tok, ok := gatewayTokens.Load(r.URL.Host); ok && r.Header.Get("Authorization") == "" {
		r = r.Clone(r.Context())
		r.Header.Set("Authorization", "Bearer "+tok.(string))
	}
	return http.DefaultTransport.RoundTrip(r)
}
