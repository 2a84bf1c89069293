#!/usr/bin/env bash
# xds-protos (the epp extra) ships its own, older copy of opentelemetry/proto/*, which
# overwrites opentelemetry-proto's files (the otel extra) when pip installs it last; the OTLP
# exporter then fails to import (no InstrumentationScope). Reinstalling opentelemetry-proto
# puts its files back; Envoy's protos work with the newer OpenTelemetry messages.
#   bash deploy/otel-protos.sh PYTHON
set -euo pipefail
py="${1:-python}"
version="$("$py" -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))' 2>/dev/null || true)"
if [ -n "$version" ]; then
  "$py" -m pip install -q --force-reinstall --no-deps "opentelemetry-proto==$version"
fi
