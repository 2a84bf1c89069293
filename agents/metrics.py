"""The node agent's Prometheus metrics: what it read from its engine and what it published,
per node (a data-parallel engine's ranks are agents of one process)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["AgentCollector", "agent_registry"]


class AgentCollector:
    """Reads the agents' own counters at scrape time (nothing to keep in step)."""

    def __init__(self, agents: Sequence[Any]) -> None:
        self.agents = agents

    def collect(self) -> Iterator[Metric]:
        def counter(name: str, doc: str, values: Iterable[tuple[str, float]]) -> Metric:
            m = CounterMetricFamily(name, doc, labels=["node"])
            for node, v in values:
                m.add_metric([node], v)
            return m

        def gauge(name: str, doc: str, values: Iterable[tuple[str, float]]) -> Metric:
            m = GaugeMetricFamily(name, doc, labels=["node"])
            for node, v in values:
                m.add_metric([node], v)
            return m

        a = [(x.settings.node_id, x) for x in self.agents]
        yield counter(
            "kvgate_agent_heartbeats", "Heartbeats published", ((n, x.heartbeats) for n, x in a)
        )
        yield counter(
            "kvgate_agent_kv_batches", "KV batches published", ((n, x.kv_batches) for n, x in a)
        )
        yield counter(
            "kvgate_agent_kv_blocks_translated",
            "Engine blocks chained into kvgate's block hashes",
            ((n, x.translator.translated_blocks) for n, x in a),
        )
        yield counter(
            "kvgate_agent_kv_blocks_untranslatable",
            "Engine blocks that could not be chained (parent never seen, tokens missing)",
            ((n, x.translator.untranslatable_blocks) for n, x in a),
        )
        skipped = CounterMetricFamily(
            "kvgate_agent_kv_blocks_skipped",
            "Engine blocks kept out of the index on purpose, by why",
            labels=["node", "reason"],
        )
        for n, x in a:
            for reason, count in sorted(x.translator.skipped_blocks.items()):
                skipped.add_metric([n, reason], count)
        yield skipped
        yield counter(
            "kvgate_agent_kv_events_undecodable",
            "Engine KV event batches and events that could not be decoded",
            ((n, x.undecodable) for n, x in a),
        )
        yield counter(
            "kvgate_agent_kv_events_lost",
            "Engine KV event batches neither received nor replayed",
            ((n, x.engine_gaps) for n, x in a),
        )
        yield counter(
            "kvgate_agent_engine_restarts",
            "Engine restarts seen",
            ((n, x.restarts.count) for n, x in a),
        )
        yield counter(
            "kvgate_agent_scrape_failures",
            "Failed reads of the engine's /metrics",
            ((n, x.scrape_failures) for n, x in a),
        )
        yield counter(
            "kvgate_agent_prewarmed",
            "Pre-warm requests the engine served",
            ((n, x.prewarmed) for n, x in a),
        )
        yield counter(
            "kvgate_agent_prewarm_refused",
            "Pre-warm advice not applied: not signed with a control key (kafka.control_keys)",
            ((n, x.prewarmer.refused) for n, x in a),
        )
        yield counter(
            "kvgate_agent_prefill_probe_failures",
            "Prefill probes of the engine that gave no rate (busy, refused, timed out)",
            ((n, x.probe.failures) for n, x in a),
        )
        yield gauge(
            "kvgate_agent_engine_prefill_tokens_per_s",
            "The engine's prefill rate as the agent's probe measured it (0: not yet)",
            ((n, x.probe.rate or 0.0) for n, x in a),
        )
        yield gauge(
            "kvgate_agent_kv_blocks",
            "Blocks the engine holds now (index keys)",
            ((n, x.translator.blocks) for n, x in a),
        )
        yield gauge(
            "kvgate_agent_kv_index_degraded",
            "1 when the node's KV events do not arrive or do not translate",
            ((n, 1.0 if x.kv_index_state == "degraded" else 0.0) for n, x in a),
        )
        if a:
            bus = a[0][1].bus
            yield GaugeMetricFamily(
                "kvgate_agent_kafka_queued", "Messages waiting for Kafka", value=bus.queued
            )
            dropped = CounterMetricFamily(
                "kvgate_agent_kafka_dropped", "Messages dropped, the outbox full", labels=["topic"]
            )
            for topic, n in sorted(bus.dropped.items()):
                dropped.add_metric([topic], n)
            yield dropped


def agent_registry(agents: Sequence[Any]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(AgentCollector(agents))
    return registry
