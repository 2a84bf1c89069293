"""The simulated engine's KV connector (vLLM's NixlConnector, as disaggregated prefill uses it):
a prefill engine answers what a decode engine pulls; a decode engine pulls the prompt's KV over
the link's bandwidth and computes only the last prompt token."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from agents.scheduler import EngineCore, Sequence
from agents.settings import EngineSettings
from streams.openai import ChatRequest, CompletionRequest

__all__ = ["exported", "receive", "transfer_params"]


def transfer_params(
    settings: EngineSettings, body: CompletionRequest | ChatRequest
) -> dict[str, Any] | None:
    """The request's kv_transfer_params, when this engine has a KV connector."""
    params = (body.model_extra or {}).get("kv_transfer_params")
    return params if settings.kv_transfer and isinstance(params, dict) else None


async def receive(
    settings: EngineSettings, core: EngineCore, seq: Sequence, params: dict[str, Any]
) -> None:
    """Pull the prompt's KV from the prefill engine named in ``params`` (NixlConnector's
    do_remote_prefill): the transfer takes its bytes over the link's bandwidth; the last
    prompt token is computed here, as vLLM does."""
    ids = params.get("remote_block_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        return
    p = settings.profile
    blocks = min(len(ids), max(0, (len(seq.prompt) - 1) // p.block_size))
    seconds = blocks * p.block_size * p.kv_bytes_per_token * 8 / (settings.kv_link_gbps * 1e9)
    await asyncio.sleep(seconds)
    core.receive(seq, blocks)


def exported(
    settings: EngineSettings, engine_id: str, seq: Sequence, request: web.Request
) -> dict[str, Any]:
    """What a prefill engine answers for a decode engine to pull (vLLM's NixlConnector
    request_finished): its engine id, side channel and the prompt's blocks."""
    bs = settings.profile.block_size
    host, port = (request.url.host or "127.0.0.1"), (request.url.port or settings.port)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(len(seq.prompt) // bs)),
        "remote_engine_id": engine_id,
        "remote_request_id": seq.request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }
