#!/usr/bin/env bash
# Apache Kafka in KRaft mode, single node on 127.0.0.1, from jars resolved by Maven.
#   deploy/kafka/kafka.sh install   resolve the jars into $KVGATE_LOCAL/kafka/libs
#   deploy/kafka/kafka.sh start     format storage (first time), start, wait until ready
#   deploy/kafka/kafka.sh stop      stop the broker this script started (by its PID file)
#   deploy/kafka/kafka.sh status    exit 0 when the broker answers
# Environment: KVGATE_LOCAL (state dir, default <repo>/.local), KVGATE_KAFKA_PORT (default 19092),
# KVGATE_KAFKA_CONTROLLER_PORT (default 19093), KVGATE_KAFKA_HEAP (default 768m).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
local_dir="${KVGATE_LOCAL:-$repo/.local}"
home="$local_dir/kafka"
port="${KVGATE_KAFKA_PORT:-19092}"
cport="${KVGATE_KAFKA_CONTROLLER_PORT:-19093}"
heap="${KVGATE_KAFKA_HEAP:-768m}"
data="$home/data-$port"
pidfile="$home/kafka-$port.pid"
logfile="$home/kafka-$port.log"

install() {
  mkdir -p "$home"
  if [ -f "$home/libs/.complete" ] && cmp -s "$here/pom.xml" "$home/libs/.complete"; then
    return 0
  fi
  rm -rf "$home/libs"
  mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies \
      -DoutputDirectory="$home/libs" -DincludeScope=runtime
  cp "$here/pom.xml" "$home/libs/.complete"
}

ready() {
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || return 1
  # a broker started from another checkout has no log here: the open port is all we can see
  [ -f "$logfile" ] || return 0
  grep -q "Kafka Server started" "$logfile" 2>/dev/null
}

start() {
  install
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "kafka already running (pid $(cat "$pidfile")) on 127.0.0.1:$port"
    return 0
  fi
  mkdir -p "$data"
  cat > "$home/server-$port.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$data
num.partitions=4
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=8
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
log.retention.hours=24
log.segment.bytes=67108864
log.cleaner.dedupe.buffer.size=33554432
PROPS
  cat > "$home/log4j.properties" <<PROPS
log4j.rootLogger=WARN, file
log4j.appender.file=org.apache.log4j.FileAppender
log4j.appender.file.File=$logfile
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.server.KafkaRaftServer=INFO
log4j.logger.kafka.server.BrokerServer=INFO
PROPS
  local cp="$home/libs/*"
  if [ ! -f "$data/meta.properties" ]; then
    java -cp "$cp" kafka.tools.StorageTool format -t "$(java -cp "$cp" kafka.tools.StorageTool random-uuid)" \
      -c "$home/server-$port.properties" >/dev/null
  fi
  : > "$logfile"
  nohup java -Xms256m "-Xmx$heap" -XX:+UseG1GC -Djava.awt.headless=true \
    "-Dlog4j.configuration=file:$home/log4j.properties" \
    -cp "$cp" kafka.Kafka "$home/server-$port.properties" >"$home/kafka-$port.out" 2>&1 &
  echo $! > "$pidfile"
  for _ in $(seq 1 120); do
    if ready; then echo "kafka ready on 127.0.0.1:$port (pid $(cat "$pidfile"))"; return 0; fi
    if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "kafka exited during start; see $logfile and $home/kafka-$port.out" >&2
      tail -20 "$home/kafka-$port.out" >&2 || true
      return 1
    fi
    sleep 0.5
  done
  echo "kafka did not become ready in 60 s; see $logfile" >&2
  return 1
}

stop() {
  [ -f "$pidfile" ] || return 0
  local pid; pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$pidfile"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) ready ;;
  # its data, log and configuration gone (a broker of a test's own, on a port of its own)
  wipe) stop; rm -rf "$data" "$logfile" "$home/kafka-$port.out" "$home/server-$port.properties" ;;
  *) echo "usage: $0 install|start|stop|status|wipe" >&2; exit 2 ;;
esac
