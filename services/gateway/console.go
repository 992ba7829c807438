package gateway

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"mime"
	"net/http"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

// The web console (issue 15) is a static front end built from console/src
// by `make console` (esbuild; console/package-lock.json pins it and uPlot)
// into console/dist, which is committed so that neither CI nor a build of
// the gateway needs npm, and embedded here. The app answers at / and at
// every deep link under /ui/ (the browser's history API routes inside
// it); its scripts and styles are under /ui/assets/ with content-hashed
// names, so they may be cached for a year. Nothing comes from elsewhere at
// run time.
//
//go:embed console/dist
var consoleDist embed.FS

// consolePrefix is where the app's views live; consoleAssets is where its
// files are.
const (
	consolePrefix = "/ui/"
	consoleAssets = "/ui/assets/"
)

// consoleCSP forbids anything but the app's own files and its API calls.
// uPlot positions its parts through element.style (allowed) and its
// legend through style attributes, hence 'unsafe-inline' for styles only.
const consoleCSP = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; " +
	"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"

// consoleFile is one file of dist, with its gzip form when that is smaller.
type consoleFile struct {
	name, contentType string
	body, gz          []byte
	// etag is the content's hash (the asset names are hashes too).
	etag string
}

// consoleFiles reads dist once: index.html and assets/*, keyed by their
// path under dist.
var consoleFiles = sync.OnceValues(func() (map[string]*consoleFile, error) {
	dist, err := fs.Sub(consoleDist, "console/dist")
	if err != nil {
		return nil, err
	}
	files := map[string]*consoleFile{}
	err = fs.WalkDir(dist, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(dist, p)
		if err != nil {
			return err
		}
		f := &consoleFile{name: p, body: b, contentType: mime.TypeByExtension(path.Ext(p))}
		switch path.Ext(p) {
		case ".js", ".mjs":
			f.contentType = "text/javascript; charset=utf-8"
		case ".css":
			f.contentType = "text/css; charset=utf-8"
		case ".html":
			f.contentType = "text/html; charset=utf-8"
		case ".json":
			f.contentType = "application/json"
		}
		if f.contentType == "" {
			f.contentType = "application/octet-stream"
		}
		var buf bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		_, _ = zw.Write(b)
		if zw.Close() == nil && buf.Len() < len(b) {
			f.gz = buf.Bytes()
		}
		sum := sha256.Sum256(b)
		f.etag = hex.EncodeToString(sum[:12])
		files[p] = f
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the embedded console: %w", err)
	}
	if files["index.html"] == nil {
		return nil, fmt.Errorf("the embedded console has no index.html: run make console")
	}
	return files, nil
})

// console answers / and every view under /ui/ with the app's page: never
// cached, so a new gateway's assets are picked up at the next load.
func (s *server) console(w http.ResponseWriter, r *http.Request) {
	files, err := consoleFiles()
	if err != nil {
		s.log.Error("console", "err", err)
		writeError(w, http.StatusInternalServerError, contracts.ReasonInternal, "the console is missing from this build", nil)
		return
	}
	h := w.Header()
	h.Set("Cache-Control", "no-cache")
	h.Set("Content-Security-Policy", consoleCSP)
	h.Set("Referrer-Policy", "no-referrer")
	s.serveConsoleFile(w, r, files["index.html"])
}

// consoleAsset answers /ui/assets/{file}: a content-hashed file, cached
// for a year; 404 for any other name.
func (s *server) consoleAsset(w http.ResponseWriter, r *http.Request) {
	files, err := consoleFiles()
	name := strings.TrimPrefix(r.URL.Path, "/ui/")
	f := files[name]
	if err != nil || f == nil || !strings.HasPrefix(name, "assets/") {
		writeError(w, http.StatusNotFound, contracts.ReasonNotFound, fmt.Sprintf("no such path %s", r.URL.Path), nil)
		return
	}
	w.Header().Set("Cache-Control", "public, max-age=31536000, immutable")
	s.serveConsoleFile(w, r, f)
}

func (s *server) serveConsoleFile(w http.ResponseWriter, r *http.Request, f *consoleFile) {
	h := w.Header()
	h.Set("Content-Type", f.contentType)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Add("Vary", "Accept-Encoding")
	body, etag := f.body, `"`+f.etag+`"`
	if f.gz != nil && acceptsGzip(r) {
		h.Set("Content-Encoding", "gzip")
		body, etag = f.gz, `"`+f.etag+`-gz"`
	}
	// ServeContent answers HEAD, Range and If-None-Match.
	h.Set("ETag", etag)
	http.ServeContent(w, r, f.name, time.Time{}, bytes.NewReader(body))
}

// consoleRoutes registers the app's views and assets. They are public (the
// page holds no data; every API call it makes needs a token) and not API
// operations, so they stay out of the OpenAPI document and its route
// table: TestConsoleRoutes covers them instead.
func (s *server) consoleRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET "+consoleAssets, s.consoleAsset)
	mux.HandleFunc("GET "+consolePrefix, s.console)
	mux.HandleFunc(consolePrefix, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Allow", "GET, HEAD")
		writeError(w, http.StatusMethodNotAllowed, contracts.ReasonMethodNotAllowed,
			fmt.Sprintf("%s is not allowed on %s; allowed: GET, HEAD", r.Method, r.URL.Path), nil)
	})
}

// isConsolePath reports whether p is served by the console, without
// credentials.
func isConsolePath(p string) bool {
	return p == "/ui" || strings.HasPrefix(p, consolePrefix)
}

func acceptsGzip(r *http.Request) bool {
	for _, part := range strings.Split(r.Header.Get("Accept-Encoding"), ",") {
		enc, q, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.TrimSpace(enc) == "gzip" && strings.ReplaceAll(strings.TrimSpace(q), " ", "") != "q=0" {
			return true
		}
	}
	return false
}
