#!/usr/bin/env bash
# Installs everything kvgate needs on a fresh Debian machine, idempotently:
# Java 17 and Maven (for the Kafka jars), redis-server, nghttp2's client, a Python 3.11 virtualenv in .venv with
# kvgate and its dev tools, Helm and the Go modules of the deployment validators, and the Kafka
# broker jars resolved from Maven Central.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# each step says what it does, then how long it took (the whole run takes minutes)
t_start=$SECONDS
t_step=$SECONDS
step() {
  if [ -n "${step_name:-}" ]; then
    echo "setup: ${step_name} done ($((SECONDS - t_step)) s)"
  fi
  step_name="$1"
  t_step=$SECONDS
  [ -z "$1" ] || echo "setup: $1 ..."
}

need_apt=()
command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need_apt+=(maven)
command -v redis-server >/dev/null || need_apt+=(redis-server)
# nghttp2's client: the endpoint picker's own HTTP/2 is tested against another implementation
command -v nghttp >/dev/null || need_apt+=(nghttp2-client)
if [ ${#need_apt[@]} -gt 0 ]; then
  step "system packages (${need_apt[*]})"
  if [ "$(id -u)" != 0 ]; then
    echo "missing system packages: ${need_apt[*]} (install them, or run as root)" >&2; exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

py="${KVGATE_PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      py="$cand"; break
    fi
  done
fi
[ -n "$py" ] || { echo "kvgate needs Python 3.11 (set KVGATE_PYTHON)" >&2; exit 1; }

step "the Python environment (.venv: kvgate and its dev tools)"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
bash deploy/otel-protos.sh .venv/bin/python

# Go builds the compose validator (compose-go, the loader docker compose uses) the tests run
step "Go and the deployment validators' modules"
if ! command -v go >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-go >/dev/null
  else
    echo "missing Go (install golang-go, or Go from go.dev)" >&2; exit 1
  fi
fi
# an older distribution Go fetches the toolchain go.mod asks for from the module proxy
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
(cd deploy/compose/check && go mod download)
(cd deploy/helm/check && go mod download)
# a gRPC client on grpc-go: the endpoint picker's own HTTP/2 is tested against it too
(cd tests/interop/grpcgo && go mod download)
# Helm, built from its Go module (the chart's lint and template tests run it)
helm_version=v3.22.0
bin="${KVGATE_LOCAL:-$repo/.local}/bin"
if ! "$bin/helm" version --short 2>/dev/null | grep -q "^${helm_version%.*}"; then
  step "Helm $helm_version (built from its Go module)"
  mkdir -p "$bin"
  GOBIN="$bin" go install "helm.sh/helm/v3/cmd/helm@$helm_version"
fi

step "the Kafka broker's jars (Maven Central)"
bash deploy/kafka/kafka.sh install
step ""
echo "kvgate installed: .venv/bin/kvgate ($((SECONDS - t_start)) s in all)"
