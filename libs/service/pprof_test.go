package service

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestPprofListener(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	tests := []struct {
		name        string
		addr        string
		allowRemote bool
		wantErr     string
	}{
		{name: "loopback v4", addr: "127.0.0.1:0"},
		{name: "loopback v6", addr: "[::1]:0"},
		{name: "names refused, localhost too", addr: "localhost:0", wantErr: "not a loopback IP"},
		{name: "all interfaces refused", addr: ":0", wantErr: "not a loopback IP"},
		{name: "wildcard refused", addr: "0.0.0.0:0", wantErr: "not a loopback IP"},
		{name: "other name refused", addr: "example.com:0", wantErr: "not a loopback IP"},
		{name: "remote allowed explicitly", addr: "0.0.0.0:0", allowRemote: true},
		{name: "no port", addr: "127.0.0.1", wantErr: "pprof address"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			addr, err := StartPprof(ctx, tc.addr, tc.allowRemote, log)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("StartPprof(%q) = %v; want an error with %q", tc.addr, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				if strings.Contains(tc.addr, "::1") && strings.Contains(err.Error(), "listen") {
					t.Skipf("no IPv6 loopback here: %v", err)
				}
				t.Fatal(err)
			}
			if strings.HasPrefix(addr, "0.0.0.0:") {
				addr = "127.0.0.1:" + strings.TrimPrefix(addr, "0.0.0.0:")
			}
			// A heap profile (debug=1: text) proves the handlers answer;
			// a CPU profile would take its seconds.
			resp, err := http.Get("http://" + addr + "/debug/pprof/heap?debug=1")
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "heap profile") {
				t.Fatalf("heap profile: %s %.200s", resp.Status, body)
			}
		})
	}
}

func TestPprofOffByDefault(t *testing.T) {
	t.Setenv(PprofAddrEnv, "")
	if err := startPprofFromEnv(context.Background(), slog.New(slog.DiscardHandler)); err != nil {
		t.Fatalf("no address: %v; want nothing started", err)
	}
	t.Setenv(PprofAddrEnv, "0.0.0.0:0")
	t.Setenv(PprofAllowRemoteEnv, "")
	if err := startPprofFromEnv(context.Background(), slog.New(slog.DiscardHandler)); err == nil {
		t.Fatal("a non-loopback address without the opt-in started a listener")
	}
}

// TestPprofLeavesTheDefaultMuxAlone: net/http/pprof's init would register
// its handlers on http.DefaultServeMux, exposing them on any server of
// the process that uses it, listener or not.
func TestPprofLeavesTheDefaultMuxAlone(t *testing.T) {
	srv := httptest.NewServer(nil) // nil: http.DefaultServeMux
	defer srv.Close()
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/heap"} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("default mux GET %s: %s; want 404", path, resp.Status)
		}
	}
}

// TestPprofServesProfiles: what go tool pprof fetches (a CPU profile, a
// named profile) and clear answers for what does not exist.
func TestPprofServesProfiles(t *testing.T) {
	srv := httptest.NewServer(pprofHandler())
	defer srv.Close()
	for _, tc := range []struct {
		path     string
		status   int
		gzipped  bool
		contains string
	}{
		{path: "/debug/pprof/profile?seconds=1", status: http.StatusOK, gzipped: true},
		{path: "/debug/pprof/heap", status: http.StatusOK, gzipped: true},
		{path: "/debug/pprof/goroutine?debug=1", status: http.StatusOK, contains: "goroutine profile"},
		{path: "/debug/pprof/", status: http.StatusOK, contains: "heap ("},
		{path: "/debug/pprof/nosuch", status: http.StatusNotFound, contains: `unknown profile "nosuch"`},
	} {
		t.Run(tc.path, func(t *testing.T) {
			resp, err := http.Get(srv.URL + tc.path)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Fatalf("%s %.200s; want %d", resp.Status, body, tc.status)
			}
			// Profiles in the proto format are gzipped: the magic bytes.
			if tc.gzipped && (len(body) < 2 || body[0] != 0x1f || body[1] != 0x8b) {
				t.Errorf("body of %d bytes is not a gzipped profile", len(body))
			}
			if !strings.Contains(string(body), tc.contains) {
				t.Errorf("body %.200q; want it to contain %q", body, tc.contains)
			}
		})
	}
}
