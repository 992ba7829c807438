package gateway

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/gpuplane/gpuplane/contracts"
)

// consoleManifest is console/dist/manifest.json, written by build.mjs.
type consoleManifest struct {
	SourceHash string   `json:"sourceHash"`
	Sources    []string `json:"sources"`
	JS         string   `json:"js"`
	CSS        string   `json:"css"`
	Sizes      map[string]struct {
		Bytes int `json:"bytes"`
		Gzip  int `json:"gzip"`
	} `json:"sizes"`
}

func readManifest(t *testing.T) consoleManifest {
	t.Helper()
	b, err := fs.ReadFile(consoleDist, "console/dist/manifest.json")
	if err != nil {
		t.Fatalf("the embedded console has no manifest (run make console): %v", err)
	}
	var m consoleManifest
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// consoleSources lists what build.mjs hashes: its own inputs and every
// file under src/, relative, "/"-separated, sorted bytewise.
func consoleSources(t *testing.T, root string) []string {
	t.Helper()
	out := []string{"build.mjs", "package.json", "package-lock.json"}
	err := filepath.WalkDir(filepath.Join(root, "src"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(root, p)
		out = append(out, filepath.ToSlash(rel))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// TestConsoleDistIsCurrent fails when console/dist was built from other
// sources than those in the tree (a change to src/ without make console):
// the hash build.mjs recorded must be the hash of the sources now, by the
// same recipe (SHA-256 over "<path>\n<length>\n<bytes>" per source).
func TestConsoleDistIsCurrent(t *testing.T) {
	m := readManifest(t)
	root := "console"
	sources := consoleSources(t, root)
	if !slices.Equal(sources, m.Sources) {
		t.Errorf("console sources are %v, dist was built from %v: run make console", sources, m.Sources)
	}
	h := sha256.New()
	for _, p := range sources {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		h.Write([]byte(p + "\n" + strconv.Itoa(len(b)) + "\n"))
		h.Write(b)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != m.SourceHash {
		t.Fatalf("console/dist is older than its sources (hash %s, dist built from %s): run make console and commit dist", got, m.SourceHash)
	}
	// dist holds what the manifest names and nothing stale beside it.
	var assets []string
	if err := fs.WalkDir(consoleDist, "console/dist/assets", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			assets = append(assets, strings.TrimPrefix(p, "console/dist/"))
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	slices.Sort(assets)
	want := []string{m.JS, m.CSS}
	slices.Sort(want)
	if !slices.Equal(assets, want) {
		t.Errorf("dist/assets holds %v, the manifest names %v", assets, want)
	}
	for _, p := range []string{m.JS, m.CSS} {
		if !regexp.MustCompile(`^assets/[a-z]+-[A-Z0-9]{8,}\.(js|css)$`).MatchString(p) {
			t.Errorf("asset %q has no content hash in its name: it could not be cached for a year", p)
		}
	}
}

// TestConsoleRoutes: the app answers / and every deep link under /ui/
// with its page, without credentials and never cached; its assets with
// their content types, a year's cache, gzip when asked and 304 on a
// revalidation; anything else under /ui/assets/ is a 404 APIError, a
// method other than GET or HEAD a 405 one.
func TestConsoleRoutes(t *testing.T) {
	h := startGateway(t, nil, nil)
	m := readManifest(t)
	// A plain client: these are not API operations, so they are not in the
	// OpenAPI document h.hc checks every answer against.
	hc := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	index, err := fs.ReadFile(consoleDist, "console/dist/index.html")
	if err != nil {
		t.Fatal(err)
	}
	js, _ := fs.ReadFile(consoleDist, "console/dist/"+m.JS)
	css, _ := fs.ReadFile(consoleDist, "console/dist/"+m.CSS)
	for _, ref := range []string{`src="/ui/` + m.JS + `"`, `href="/ui/` + m.CSS + `"`, `id="app"`} {
		if !bytes.Contains(index, []byte(ref)) {
			t.Errorf("index.html lacks %s", ref)
		}
	}
	if regexp.MustCompile(`(src|href)="(https?:)?//`).Match(index) {
		t.Errorf("index.html loads something from elsewhere:\n%s", index)
	}

	const page, immutable = "no-cache", "public, max-age=31536000, immutable"
	tests := map[string]struct {
		method, path, encoding string
		status                 int
		contentType, cache     string
		body                   []byte
		reason                 contracts.Reason
	}{
		"root":                  {"GET", "/", "", 200, "text/html; charset=utf-8", page, index, ""},
		"fleet":                 {"GET", "/ui/fleet", "", 200, "text/html; charset=utf-8", page, index, ""},
		"machine deep link":     {"GET", "/ui/fleet/nodes/h100-01", "", 200, "text/html; charset=utf-8", page, index, ""},
		"job deep link":         {"GET", "/ui/jobs/acme/train-7", "", 200, "text/html; charset=utf-8", page, index, ""},
		"job list with query":   {"GET", "/ui/jobs?tenant=acme&q=x", "", 200, "text/html; charset=utf-8", page, index, ""},
		"queues, cost and ops":  {"GET", "/ui/ops", "", 200, "text/html; charset=utf-8", page, index, ""},
		"unknown view":          {"GET", "/ui/nowhere/at/all", "", 200, "text/html; charset=utf-8", page, index, ""},
		"script":                {"GET", "/ui/" + m.JS, "", 200, "text/javascript; charset=utf-8", immutable, js, ""},
		"styles":                {"GET", "/ui/" + m.CSS, "", 200, "text/css; charset=utf-8", immutable, css, ""},
		"script gzipped":        {"GET", "/ui/" + m.JS, "gzip, deflate", 200, "text/javascript; charset=utf-8", immutable, js, ""},
		"HEAD of the page":      {"HEAD", "/ui/cost", "", 200, "text/html; charset=utf-8", page, nil, ""},
		"missing asset":         {"GET", "/ui/assets/app-NOPE.js", "", 404, "application/json", "", nil, contracts.ReasonNotFound},
		"only files of assets/": {"GET", "/ui/assets/index.html", "", 404, "application/json", "", nil, contracts.ReasonNotFound},
		"POST a view":           {"POST", "/ui/jobs", "", 405, "application/json", "", nil, contracts.ReasonMethodNotAllowed},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), tt.method, h.url+tt.path, nil)
			if err != nil {
				t.Fatal(err)
			}
			if tt.encoding != "" {
				req.Header.Set("Accept-Encoding", tt.encoding)
			}
			res, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			body, _ := io.ReadAll(res.Body)
			if res.StatusCode != tt.status || res.Header.Get("Content-Type") != tt.contentType {
				t.Fatalf("%s %s: %d %s, want %d %s\n%s", tt.method, tt.path, res.StatusCode, res.Header.Get("Content-Type"), tt.status, tt.contentType, body)
			}
			if tt.reason != "" {
				var apiErr contracts.APIError
				if err := json.Unmarshal(body, &apiErr); err != nil || apiErr.Error.Reason != tt.reason {
					t.Fatalf("body %s, want an APIError %s", body, tt.reason)
				}
				if tt.status == 405 && res.Header.Get("Allow") != "GET, HEAD" {
					t.Errorf("Allow = %q", res.Header.Get("Allow"))
				}
				return
			}
			if got := res.Header.Get("Cache-Control"); got != tt.cache {
				t.Errorf("Cache-Control = %q, want %q", got, tt.cache)
			}
			if res.Header.Get("X-Content-Type-Options") != "nosniff" {
				t.Error("no X-Content-Type-Options: nosniff")
			}
			if tt.cache == page && !strings.Contains(res.Header.Get("Content-Security-Policy"), "script-src 'self'") {
				t.Errorf("page CSP = %q", res.Header.Get("Content-Security-Policy"))
			}
			if tt.encoding != "" {
				if res.Header.Get("Content-Encoding") != "gzip" {
					t.Fatalf("Content-Encoding = %q, want gzip", res.Header.Get("Content-Encoding"))
				}
				zr, err := gzip.NewReader(bytes.NewReader(body))
				if err != nil {
					t.Fatal(err)
				}
				if body, err = io.ReadAll(zr); err != nil {
					t.Fatal(err)
				}
			} else if res.Header.Get("Content-Encoding") != "" {
				t.Fatalf("Content-Encoding %q without Accept-Encoding", res.Header.Get("Content-Encoding"))
			}
			if tt.method == "HEAD" {
				if len(body) != 0 {
					t.Fatalf("HEAD answered a body of %d bytes", len(body))
				}
				return
			}
			if !bytes.Equal(body, tt.body) {
				t.Fatalf("body is %d bytes, not the embedded file's %d", len(body), len(tt.body))
			}
			// A browser revalidating what it holds gets 304 and no body.
			req2, _ := http.NewRequestWithContext(t.Context(), tt.method, h.url+tt.path, nil)
			if tt.encoding != "" {
				req2.Header.Set("Accept-Encoding", tt.encoding)
			}
			req2.Header.Set("If-None-Match", res.Header.Get("ETag"))
			res2, err := hc.Do(req2)
			if err != nil {
				t.Fatal(err)
			}
			res2.Body.Close()
			if res.Header.Get("ETag") == "" || res2.StatusCode != http.StatusNotModified {
				t.Errorf("revalidation with ETag %q: %d, want 304", res.Header.Get("ETag"), res2.StatusCode)
			}
		})
	}
}

// TestConsoleIsSmall keeps the console light: the page, its script and
// styles together stay under 80 KB gzipped (uPlot is about 20 of them).
func TestConsoleIsSmall(t *testing.T) {
	m := readManifest(t)
	total := 0
	for name, s := range m.Sizes {
		total += s.Gzip
		t.Logf("%s: %d bytes, %d gzipped", name, s.Bytes, s.Gzip)
	}
	if total == 0 || total > 80_000 {
		t.Fatalf("the console weighs %d bytes gzipped, want under 80,000", total)
	}
}
