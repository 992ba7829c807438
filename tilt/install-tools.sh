#!/usr/bin/env bash
# Installs the tools the Tilt setup needs into ./.tools/bin at pinned
# versions, skipping what is already there: nats-server, tilt and jaeger. The Go
# module proxy refuses @latest for some modules, so every version is pinned;
# tilt's module has replace directives and ships no web assets, so it is
# built from a writable copy of the downloaded module (recipe: shared/TOOLS.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/.tools/bin"
mkdir -p "$bin"
NATS_SERVER_VERSION=v2.15.2
TILT_VERSION=v0.34.0
JAEGER_VERSION=v1.76.0

want() { # want NAME VERSION: true when bin/NAME is missing or another version
  [ ! -x "$bin/$1" ] || [ "$(cat "$bin/.$1.version" 2>/dev/null)" != "$2" ]
}

if want nats-server "$NATS_SERVER_VERSION"; then
  echo "installing nats-server $NATS_SERVER_VERSION"
  GOBIN="$bin" GOWORK=off go install "github.com/nats-io/nats-server/v2@$NATS_SERVER_VERSION"
  echo "$NATS_SERVER_VERSION" > "$bin/.nats-server.version"
fi

if [ "${1:-}" = "--with-tilt" ] && want tilt "$TILT_VERSION"; then
  echo "building tilt $TILT_VERSION (about 5 minutes the first time)"
  dir=$(GONOSUMDB=github.com/tilt-dev/tilt GOWORK=off go mod download -json "github.com/tilt-dev/tilt@$TILT_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  work=$(mktemp -d)
  trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
  cp -r "$dir/." "$work/"
  chmod -R u+w "$work"
  mkdir -p "$work/pkg/assets/build"
  echo '<!doctype html><title>tilt</title><p>Tilt web UI assets are not shipped in the Go module; use the CLI.</p>' > "$work/pkg/assets/build/index.html"
  (cd "$work" && GOWORK=off GOFLAGS=-mod=mod go build -o "$bin/tilt" ./cmd/tilt)
  echo "$TILT_VERSION" > "$bin/.tilt.version"
fi

# Jaeger (the v2 binary, ./cmd/jaeger of module v1.76.0) receives the
# services' OTLP traces under Tilt and in e2e's trace test. Its module has
# replace directives, so it is built from a writable copy like tilt.
if { [ "${1:-}" = "--with-tilt" ] || [ "${1:-}" = "--with-jaeger" ] || [ "${2:-}" = "--with-jaeger" ]; } && want jaeger "$JAEGER_VERSION"; then
  echo "building jaeger $JAEGER_VERSION (about 5.5 minutes the first time)"
  dir=$(GOWORK=off go mod download -json "github.com/jaegertracing/jaeger@$JAEGER_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  jwork=$(mktemp -d)
  cp -r "$dir/." "$jwork/"
  chmod -R u+w "$jwork"
  (cd "$jwork" && GOWORK=off GOFLAGS=-mod=mod go build -o "$bin/jaeger" ./cmd/jaeger)
  chmod -R u+w "$jwork"
  rm -rf "$jwork"
  echo "$JAEGER_VERSION" > "$bin/.jaeger.version"
fi
