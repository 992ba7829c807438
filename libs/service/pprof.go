package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"strconv"
	"strings"
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

// StartPprof serves profiles (CPU, heap and every other runtime/pprof
// profile, execution traces) at the paths net/http/pprof uses, so `go tool
// pprof http://addr/debug/pprof/profile` works, on addr until ctx ends,
// and returns the address it listens on. addr must be a loopback IP
// unless allowRemote.
func StartPprof(ctx context.Context, addr string, allowRemote bool, log *slog.Logger) (string, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("pprof address %q: %w", addr, err)
	}
	if !allowRemote && !isLoopback(host) {
		return "", fmt.Errorf("pprof address %q is not a loopback IP such as 127.0.0.1 (set %s=1 to allow it)", addr, PprofAllowRemoteEnv)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("pprof listen: %w", err)
	}
	srv := &http.Server{Handler: pprofHandler(), ReadHeaderTimeout: 10 * time.Second}
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

// isLoopback says whether host is a loopback IP. Names, localhost
// included, are refused: what they resolve to is the resolver's choice.
func isLoopback(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// pprofHandler serves runtime/pprof's profiles on a mux of its own.
// net/http/pprof is not imported: its init registers its handlers on
// http.DefaultServeMux, which would expose them, unauthenticated, on any
// server of the process that uses the default mux, listener or not.
func pprofHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/pprof/{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "profile?seconds=N (CPU), trace?seconds=N, cmdline, and:")
		for _, p := range pprof.Profiles() {
			fmt.Fprintf(w, "%s (%d)\n", p.Name(), p.Count())
		}
	})
	mux.HandleFunc("GET /debug/pprof/cmdline", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprint(w, strings.Join(os.Args, "\x00"))
	})
	mux.HandleFunc("GET /debug/pprof/profile", func(w http.ResponseWriter, r *http.Request) {
		d := pprofSeconds(r, 30*time.Second)
		w.Header().Set("Content-Type", "application/octet-stream")
		if err := pprof.StartCPUProfile(w); err != nil {
			// Another CPU profile is running: one at a time per process.
			http.Error(w, "cpu profile: "+err.Error(), http.StatusConflict)
			return
		}
		sleepOrDone(r.Context(), d)
		pprof.StopCPUProfile()
	})
	mux.HandleFunc("GET /debug/pprof/trace", func(w http.ResponseWriter, r *http.Request) {
		d := pprofSeconds(r, time.Second)
		w.Header().Set("Content-Type", "application/octet-stream")
		if err := trace.Start(w); err != nil {
			http.Error(w, "trace: "+err.Error(), http.StatusConflict)
			return
		}
		sleepOrDone(r.Context(), d)
		trace.Stop()
	})
	mux.HandleFunc("GET /debug/pprof/{name}", func(w http.ResponseWriter, r *http.Request) {
		p := pprof.Lookup(r.PathValue("name"))
		if p == nil {
			http.Error(w, "unknown profile "+strconv.Quote(r.PathValue("name")), http.StatusNotFound)
			return
		}
		debug, _ := strconv.Atoi(r.URL.Query().Get("debug"))
		if debug > 0 {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		} else {
			w.Header().Set("Content-Type", "application/octet-stream")
		}
		if r.URL.Query().Get("gc") == "1" {
			runtime.GC()
		}
		_ = p.WriteTo(w, debug)
	})
	return mux
}

// pprofSeconds is the request's ?seconds=, def when absent or invalid,
// at most ten minutes.
func pprofSeconds(r *http.Request, def time.Duration) time.Duration {
	n, err := strconv.Atoi(r.URL.Query().Get("seconds"))
	if err != nil || n <= 0 {
		return def
	}
	return min(time.Duration(n)*time.Second, 10*time.Minute)
}

func sleepOrDone(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
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
