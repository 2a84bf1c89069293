#!/usr/bin/env bash
# redis-server from the OS packages on a spare loopback port, no persistence.
#   deploy/local/redis.sh install|start|stop|status
# Environment: KVGATE_LOCAL (state dir, default <repo>/.local), KVGATE_REDIS_PORT (default 16379).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
local_dir="${KVGATE_LOCAL:-$repo/.local}"
port="${KVGATE_REDIS_PORT:-16379}"
home="$local_dir/redis"
pidfile="$home/redis-$port.pid"

install() {
  command -v redis-server >/dev/null && return 0
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing: install the OS package redis-server" >&2; return 1
  fi
}

ready() { redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; }

start() {
  install
  mkdir -p "$home"
  if ready; then echo "redis already answering on 127.0.0.1:$port"; return 0; fi
  redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no --daemonize yes \
    --pidfile "$pidfile" --logfile "$home/redis-$port.log" --dir "$home"
  for _ in $(seq 1 50); do
    if ready; then echo "redis ready on 127.0.0.1:$port"; return 0; fi
    sleep 0.1
  done
  echo "redis did not start; see $home/redis-$port.log" >&2; return 1
}

stop() {
  [ -f "$pidfile" ] || return 0
  local pid; pid="$(cat "$pidfile")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  rm -f "$pidfile"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) ready ;;
  wipe) stop; rm -f "$home/redis-$port.log" ;;  # (it keeps no data)
  *) echo "usage: $0 install|start|stop|status|wipe" >&2; exit 2 ;;
esac
