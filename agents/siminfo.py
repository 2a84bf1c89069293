"""What the simulated engine says about itself, as vLLM (and SGLang, to its gateway) says it:
the model listing with its LoRA adapters, SGLang's server info, ``/tokenize``."""

from __future__ import annotations

from typing import Any

import orjson

from agents.settings import EngineSettings
from streams.openai import ChatRequest, CompletionRequest
from streams.tokenization import Tokenization

__all__ = ["model_listing", "server_info", "tokenize"]


def model_listing(settings: EngineSettings, max_len: int, started_s: float) -> dict[str, Any]:
    """vLLM's ``/v1/models``: the base model, then each LoRA adapter with the base as its
    parent."""
    name = settings.served_model_name
    entry = {"object": "model", "created": int(started_s), "owned_by": "kvgate"}
    base = {**entry, "id": name, "root": settings.profile.model, "parent": None}
    adapters = [
        {**entry, "id": lora, "root": path, "parent": name}
        for lora, path in settings.adapters.items()
    ]
    return {"object": "list", "data": [{**m, "max_model_len": max_len} for m in [base, *adapters]]}


def server_info(settings: EngineSettings) -> dict[str, Any]:
    """What SGLang's model gateway asks a worker when it registers it."""
    p = settings.profile
    return {
        "model_path": settings.served_model_name,
        "served_model_name": settings.served_model_name,
        "is_generation": True,
        "max_total_num_tokens": p.num_gpu_blocks * p.block_size,
        "page_size": p.block_size,
        "max_running_requests": p.max_num_seqs,
        "chunked_prefill_size": p.max_num_batched_tokens,
    }


def tokenize(tokenization: Tokenization, raw: bytes) -> list[int]:
    """vLLM's ``POST /tokenize``: a completion prompt or chat messages → token ids (a
    ``ValueError`` for a body that is neither)."""
    data = orjson.loads(raw)
    if isinstance(data, dict) and "messages" in data:
        return tokenization.encode_chat(ChatRequest.model_validate(data))
    return CompletionRequest.model_validate(data).prompt_tokens(tokenization.encode_prompt)
