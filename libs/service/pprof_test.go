package service

import (
	"context"
	"io"
	"log/slog"
	"net/http"
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
		{name: "localhost", addr: "localhost:0"},
		{name: "all interfaces refused", addr: ":0", wantErr: "not loopback"},
		{name: "wildcard refused", addr: "0.0.0.0:0", wantErr: "not loopback"},
		{name: "other name refused", addr: "example.com:0", wantErr: "not loopback"},
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
