"""``kvgate engine`` and ``kvgate agent``: what runs beside each GPU node — the simulated engine
(it speaks vLLM's protocols) and the node agent that publishes its heartbeats and KV events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Annotated, Any

import typer

from deploy.cli import ConfigOpt, _logging, _settings, app

__all__ = ["agent", "engine"]


@app.command()
def engine(
    config: ConfigOpt = None,
    port: Annotated[int | None, typer.Option(help="HTTP port")] = None,
    host: Annotated[str | None, typer.Option(help="address to listen on")] = None,
    kv_events_port: Annotated[int | None, typer.Option(help="ZMQ PUB port for KV events")] = None,
    kv_events_replay_port: Annotated[
        int | None, typer.Option(help="ZMQ ROUTER port answering replay requests")
    ] = None,
    num_gpu_blocks: Annotated[int | None, typer.Option(help="override the KV capacity")] = None,
    sglang: Annotated[
        bool,
        typer.Option("--sglang", help="look like SGLang: its /metrics names, no KV events"),
    ] = False,
    kv_events_connect: Annotated[
        bool,
        typer.Option(
            "--kv-events-connect", help="dial out to the KV-event port (a collector binds it)"
        ),
    ] = False,
    data_parallel_size: Annotated[
        int | None, typer.Option(help="engine cores (data-parallel ranks), each its own cache")
    ] = None,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option("--lora-modules", help="a LoRA adapter it serves: name=path (repeatable)"),
    ] = None,
) -> None:
    """Run one simulated inference engine (vLLM-compatible HTTP, metrics and KV events)."""
    from aiohttp import web

    from agents.simengine import SimEngine

    s = _settings(config).engine
    updates: dict[str, object] = {}
    if port is not None:
        updates["port"] = port
    if host is not None:
        updates["host"] = host
    if kv_events_port is not None:
        updates["kv_events_endpoint"] = f"tcp://127.0.0.1:{kv_events_port}"
    if kv_events_replay_port is not None:
        updates["kv_events_replay_endpoint"] = f"tcp://127.0.0.1:{kv_events_replay_port}"
    if num_gpu_blocks is not None:
        updates["profile"] = s.profile.model_copy(
            update={"num_gpu_blocks_override": num_gpu_blocks}
        )
    if sglang:
        updates.update(metrics_format="sglang", kv_events_endpoint=None)
    if kv_events_connect:
        updates["kv_events_connect"] = True
    if data_parallel_size is not None:
        updates["data_parallel_size"] = data_parallel_size
    s = s.model_copy(update=updates)
    if lora_modules:
        try:
            s = type(s).model_validate({**s.model_dump(), "lora_modules": lora_modules})
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
    _logging()
    web.run_app(SimEngine(s).app(), host=s.host, port=s.port, print=None, access_log=None)


@app.command()
def agent(
    config: ConfigOpt = None,
    node_id: Annotated[str | None, typer.Option(help="node id")] = None,
    engine_url: Annotated[str | None, typer.Option(help="engine base URL")] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(help="the engine's URL for routers, when not --engine-url (a sidecar's)"),
    ] = None,
    kv_events: Annotated[str | None, typer.Option(help="engine KV-event ZMQ endpoint")] = None,
    kv_events_replay: Annotated[
        str | None, typer.Option(help="engine KV-event replay endpoint (fills sequence gaps)")
    ] = None,
    engine_kind: Annotated[str | None, typer.Option(help="vllm or sglang")] = None,
    no_kv_events: Annotated[
        bool,
        typer.Option(
            "--no-kv-events",
            help="the engine publishes no KV events: routers infer its cache (approximate)",
        ),
    ] = False,
    kv_events_bind: Annotated[
        bool,
        typer.Option(
            "--kv-events-bind",
            help="bind the KV-event endpoint; the engine dials in (collector style, as in llm-d)",
        ),
    ] = False,
    data_parallel_size: Annotated[
        int | None,
        typer.Option(help="the engine's data-parallel ranks: one node each (<node-id>-dp<rank>)"),
    ] = None,
) -> None:
    """Run the node agent (sidecar) for one engine."""
    from agents.agent import NodeAgent
    from streams.kafka import KafkaBus, ensure_topics

    s = _settings(config)
    updates: dict[str, str | None] = {
        k: v
        for k, v in {
            "node_id": node_id,
            "engine_url": engine_url,
            "advertise_url": advertise_url,
            "kv_events_endpoint": kv_events,
            "kv_events_replay_endpoint": kv_events_replay,
            "engine_kind": engine_kind,
        }.items()
        if v is not None
    }
    if no_kv_events:
        updates["kv_events_endpoint"] = None
    a = s.agent.model_copy(
        update={**updates, **({"kv_events_bind": True} if kv_events_bind else {})}
    )
    _logging()

    if data_parallel_size is not None:
        a = a.model_copy(update={"data_parallel_size": data_parallel_size})

    async def main() -> None:
        await ensure_topics(s.kafka)
        bus = KafkaBus(s.kafka, f"agent-{a.node_id}")
        await bus.start()
        agents = [NodeAgent(rank, bus) for rank in a.ranks()]  # one per data-parallel rank
        runner = None
        if a.metrics_port is not None:
            from agents.metrics import agent_registry
            from streams.metrics_http import serve_metrics

            runner, _ = await serve_metrics(a.metrics_host, a.metrics_port, agent_registry(agents))
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        running = asyncio.gather(*(agent.run() for agent in agents))
        stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({running, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.is_set() and a.drain_on_stop_s > 0 and not running.done():
                # a scale-down: the routers drain the node before it goes
                logging.getLogger("agents").info("stopping: draining for %.0f s", a.drain_on_stop_s)
                for agent in agents:
                    agent.draining = True
                await asyncio.wait([running], timeout=a.drain_on_stop_s)
        finally:
            stop.cancel()
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            if runner is not None:
                await runner.cleanup()
            await bus.stop()

    asyncio.run(main())
