package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/libs/freeport"
)

// EnvRequireJaeger makes the trace test fail instead of skipping when the
// Jaeger binary is missing (.ci/run sets it after building Jaeger).
const EnvRequireJaeger = "GPUPLANE_REQUIRE_JAEGER"

// EnvSkipReport names a file each test that skips for a missing tool
// appends one line to: `make test` runs go test without -v, which prints
// only "ok" for a package and hides every skip's reason, so the Makefile
// prints this file after the run.
const EnvSkipReport = "GPUPLANE_SKIP_REPORT"

// jaegerBinary is the Jaeger v2 binary tilt/install-tools.sh builds
// (GPUPLANE_JAEGER_BIN overrides it). Without it the test skips, saying
// why where `make test` shows it, or fails under GPUPLANE_REQUIRE_JAEGER=1.
func jaegerBinary(t *testing.T) string {
	t.Helper()
	bin, why := findJaeger()
	if why != "" {
		if os.Getenv(EnvRequireJaeger) == "1" {
			t.Fatalf("%s=1 and %s", EnvRequireJaeger, why)
		}
		skipFor(t, why)
	}
	return bin
}

// findJaeger returns the Jaeger binary's absolute path, or why there is
// none usable: the path looked at (and where it came from), what is wrong
// with it, and how to build it.
func findJaeger() (bin, why string) {
	bin, from := os.Getenv("GPUPLANE_JAEGER_BIN"), "GPUPLANE_JAEGER_BIN"
	if bin == "" {
		bin, from = filepath.Join("..", ".tools", "bin", "jaeger"), "the default; GPUPLANE_JAEGER_BIN overrides it"
	}
	if abs, err := filepath.Abs(bin); err == nil {
		bin = abs
	}
	const build = "build it with `make jaeger` (tilt/install-tools.sh --with-jaeger; about 5.5 min the first time)"
	fi, err := os.Stat(bin)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "", fmt.Sprintf("no Jaeger binary at %s (%s): %s", bin, from, build)
	case err != nil:
		return "", fmt.Sprintf("Jaeger binary at %s (%s) unreadable: %v; %s", bin, from, err, build)
	case fi.IsDir() || fi.Mode().Perm()&0o111 == 0:
		return "", fmt.Sprintf("%s (%s) is not an executable file: %s", bin, from, build)
	}
	return bin, ""
}

// skipFor skips t for why, and appends the reason to the file named by
// GPUPLANE_SKIP_REPORT, where `make test` shows it.
func skipFor(t *testing.T, why string) {
	t.Helper()
	if path := os.Getenv(EnvSkipReport); path != "" {
		f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		if err == nil {
			_, err = fmt.Fprintf(f, "SKIP e2e %s: %s\n", t.Name(), why)
			err = errors.Join(err, f.Close())
		}
		if err != nil {
			t.Logf("%s: %v", EnvSkipReport, err)
		}
	}
	t.Skip(why)
}

// jaeger is a running Jaeger: OTLP/HTTP at otlp (host:port), the query
// API at api (a base URL).
type jaeger struct {
	otlp, api string
}

// startJaeger runs Jaeger with tilt/jaeger.yaml (loopback, in memory) on
// free ports until the test ends.
func startJaeger(t *testing.T) *jaeger {
	t.Helper()
	bin := jaegerBinary(t)
	cfg, err := os.ReadFile(filepath.Join("..", "tilt", "jaeger.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	ports := map[string]string{}
	text := string(cfg)
	for _, p := range []string{"4317", "4318", "16685", "16686"} {
		ports[p] = strconv.Itoa(freeport.Port(t))
		text = strings.ReplaceAll(text, "127.0.0.1:"+p, "127.0.0.1:"+ports[p])
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "jaeger.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "jaeger.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config=file:"+path)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		_ = logf.Close()
		if t.Failed() {
			if b, err := os.ReadFile(logf.Name()); err == nil {
				t.Logf("jaeger log:\n%s", tail(string(b), 4000))
			}
		}
	})
	j := &jaeger{otlp: "127.0.0.1:" + ports["4318"], api: "http://127.0.0.1:" + ports["16686"]}
	waitFor(t, 60*time.Second, "Jaeger's query API", func() (bool, string) {
		select {
		case err := <-exited:
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("jaeger exited: %v\n%s", err, tail(string(b), 4000))
		default:
		}
		resp, err := http.Get(j.api + "/api/services")
		if err != nil {
			return false, err.Error()
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	return j
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// The Jaeger query API's model (v1 JSON, what /api/traces returns).
type jTrace struct {
	TraceID   string              `json:"traceID"`
	Spans     []jSpan             `json:"spans"`
	Processes map[string]jProcess `json:"processes"`
}

type jSpan struct {
	TraceID       string `json:"traceID"`
	SpanID        string `json:"spanID"`
	OperationName string `json:"operationName"`
	References    []struct {
		RefType string `json:"refType"`
		TraceID string `json:"traceID"`
		SpanID  string `json:"spanID"`
	} `json:"references"`
	Tags      []jTag `json:"tags"`
	ProcessID string `json:"processID"`
}

type jTag struct {
	Key   string `json:"key"`
	Value any    `json:"value"`
}

type jProcess struct {
	ServiceName string `json:"serviceName"`
}

func (s jSpan) tag(key string) string {
	for _, t := range s.Tags {
		if t.Key == key {
			return fmt.Sprint(t.Value)
		}
	}
	return ""
}

func (j *jaeger) get(path string, q url.Values, out any) error {
	resp, err := http.Get(j.api + path + "?" + q.Encode())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s: %s", path, resp.Status, b)
	}
	return json.Unmarshal(b, out)
}

// findTraces is Jaeger's search: the traces with a span of service tagged
// with every tag.
func (j *jaeger) findTraces(service string, tags map[string]string, since time.Time) ([]jTrace, error) {
	tj, _ := json.Marshal(tags)
	var res struct {
		Data []jTrace `json:"data"`
	}
	q := url.Values{"service": {service}, "limit": {"10000"},
		"start": {strconv.FormatInt(since.UnixMicro(), 10)}, "end": {strconv.FormatInt(time.Now().Add(time.Minute).UnixMicro(), 10)}}
	if len(tags) > 0 {
		q.Set("tags", string(tj))
	}
	err := j.get("/api/traces", q, &res)
	return res.Data, err
}

func (j *jaeger) trace(id string) (jTrace, error) {
	var res struct {
		Data []jTrace `json:"data"`
	}
	if err := j.get("/api/traces/"+id, nil, &res); err != nil {
		return jTrace{}, err
	}
	if len(res.Data) != 1 {
		return jTrace{}, fmt.Errorf("trace %s: %d traces", id, len(res.Data))
	}
	return res.Data[0], nil
}

func (j *jaeger) services() ([]string, error) {
	var res struct {
		Data []string `json:"data"`
	}
	err := j.get("/api/services", nil, &res)
	return res.Data, err
}

func (j *jaeger) operations(service string) ([]string, error) {
	var res struct {
		Data []string `json:"data"`
	}
	err := j.get("/api/services/"+url.PathEscape(service)+"/operations", nil, &res)
	return res.Data, err
}
