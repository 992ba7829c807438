package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"time"
)

// PprofAddrEnv names the opt-in profiling listener's address
// (host:port, port 0 for any free port). Unset, nothing listens.
const PprofAddrEnv = "GPUPLANE_PPROF_ADDR"

// PprofAllowRemoteEnv, set to 1, lets the listener bind an address that
// is not loopback. Profiles show the process's memory and code paths and
// the handlers have no authentication, so by default only the machine
// itself can reach them.
const PprofAllowRemoteEnv = "GPUPLANE_PPROF_ALLOW_REMOTE"

// StartPprof serves net/http/pprof's handlers (CPU and heap profiles,
// goroutines, traces) on addr until ctx ends, and returns the address it
// listens on. addr must be a loopback address unless allowRemote.
func StartPprof(ctx context.Context, addr string, allowRemote bool, log *slog.Logger) (string, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("pprof address %q: %w", addr, err)
	}
	if !allowRemote && !isLoopback(host) {
		return "", fmt.Errorf("pprof address %q is not loopback (set %s=1 to allow it)", addr, PprofAllowRemoteEnv)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("pprof listen: %w", err)
	}
	// Its own mux: nothing else a service registers on
	// http.DefaultServeMux is exposed, and the handlers are not
	// registered on it either.
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("pprof listener stopped", "err", err)
		}
	}()
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Info("pprof listening", "addr", ln.Addr().String())
	return ln.Addr().String(), nil
}

// isLoopback says whether host (an IP or a name) is this machine only.
// A name other than localhost is refused: it could resolve elsewhere.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// startPprofFromEnv starts the listener when PprofAddrEnv is set.
func startPprofFromEnv(ctx context.Context, log *slog.Logger) error {
	addr := os.Getenv(PprofAddrEnv)
	if addr == "" {
		return nil
	}
	_, err := StartPprof(ctx, addr, os.Getenv(PprofAllowRemoteEnv) == "1", log)
	return err
}
