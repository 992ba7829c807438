// Package openapi holds the OpenAPI 3.1 description of the gateway's REST
// API, gateway.openapi.json, which the gateway serves at GET
// /v1/openapi.json. The file is generated (go generate, or make schemas)
// from the operation table in gen/build.go and the Go types of contracts,
// the same types contracts/schema/*.json is generated from: every body
// schema under components/schemas is either one of those files' definitions
// or reflected from an API type exactly as they are. gen's tests fail when
// the file is stale; services/gateway's tests fail when a route is missing
// from it and validate every response its tests see against it.
package openapi

import _ "embed"

//go:generate go run ./gen -out gateway.openapi.json

// Gateway is the document, as JSON.
//
//go:embed gateway.openapi.json
var Gateway []byte
