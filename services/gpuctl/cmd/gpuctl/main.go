// Command gpuctl is gpuplane's command-line client; see "gpuctl help".
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/gpuplane/gpuplane/services/gpuctl"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := gpuctl.Run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}
