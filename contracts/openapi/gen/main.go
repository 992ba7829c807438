// Command gen writes the gateway's OpenAPI document (go generate in
// contracts/openapi): the operations of build.go with every schema of
// contracts/schema and of the API's own types under components/schemas.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	out := flag.String("out", "gateway.openapi.json", "file to write the document to")
	flag.Parse()
	b, err := build()
	if err == nil {
		err = os.WriteFile(*out, b, 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "openapi gen:", err)
		os.Exit(1)
	}
}
