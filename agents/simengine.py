"""The simulated inference engine: one vLLM-like replica without a GPU, in real time.

HTTP (aiohttp): ``/v1/completions``, ``/v1/chat/completions`` and the agent APIs ``/v1/messages``
and ``/v1/responses`` (SSE streaming and plain JSON, in each API's shape: agents/simformats.py),
``/v1/models``, ``/health``, ``/metrics`` (vLLM's metric names), ``/reset_prefix_cache``.
KV events go out on ZeroMQ in vLLM's format. Timing and cache behaviour come from the pure
:class:`agents.scheduler.EngineCore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import orjson
from aiohttp import ClientConnectionResetError, web
from pydantic import ValidationError

from agents.enginemetrics import render_metrics, render_sglang_metrics
from agents.scheduler import EngineCore, Sequence
from agents.sequence import first_salt
from agents.settings import EngineSettings
from agents.simconnector import exported, receive, transfer_params
from agents.simfaults import EngineGate, retention_ttl
from agents.simformats import AnswerFormat
from agents.siminfo import model_listing, server_info, tokenize
from agents.vllm_events import KvEventPublisher, encode_batch, rank_endpoint
from streams.agentapis import Api, MessagesRequest, ResponsesRequest
from streams.openai import ChatRequest, CompletionRequest, error_body
from streams.tokenization import load_tokenization

__all__ = ["SimEngine"]

log = logging.getLogger(__name__)
_DONE = object()
_Body = TypeVar("_Body", CompletionRequest, ChatRequest, MessagesRequest, ResponsesRequest)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


class SimEngine:
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        # one engine core per data-parallel rank (vLLM's --data-parallel-size)
        self.cores = [EngineCore(settings.profile) for _ in range(settings.data_parallel_size)]
        self.tokenization = load_tokenization(settings.tokenizer)
        self.started_s = time.time()
        self._wakes = [asyncio.Event() for _ in self.cores]
        self._queues: dict[str, asyncio.Queue[object]] = {}
        self._rng = random.Random(settings.seed)
        # vLLM numbers the adapters it was started with 1, 2, … (its lora_int_id)
        self._lora_ids = {name: i + 1 for i, name in enumerate(settings.adapters)}
        self._publishers: list[KvEventPublisher | None] = [None] * len(self.cores)
        self._tasks: list[asyncio.Task[None]] = []
        self.gate = EngineGate(settings, self._rng)  # its API key and its simulated faults
        self.engine_id = uuid.uuid4().hex[:12]  # a KV connector's engine id
        self._streaming: dict[int, web.Request] = {}  # requests whose answer is streaming

    # --- lifecycle -----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=64 * 1024 * 1024, middlewares=[self.gate.auth, self.gate.faulty]
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/kvgate/fault", self.gate.set_fault)
        # what SGLang's model gateway asks a worker when it registers it (it falls back from
        # the first name to the older one); answering lets the gateway label the model
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            app.router.add_get(path, self._server_info)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def crash_streams(self) -> int:
        """Every answer being streamed breaks off as when the engine process dies (its
        connections reset); the number broken. The engine itself carries on."""
        broken = 0
        for request in list(self._streaming.values()):
            if request.transport is not None:
                request.transport.abort()
                broken += 1
        return broken

    @property
    def core(self) -> EngineCore:
        """The first (with one rank: the only) engine core."""
        return self.cores[0]

    async def _start(self, _: web.Application) -> None:
        s = self.settings
        for rank in range(len(self.cores)):
            if s.kv_events_endpoint:
                publisher = KvEventPublisher(
                    rank_endpoint(s.kv_events_endpoint, rank) or s.kv_events_endpoint,
                    rank_endpoint(s.kv_events_replay_endpoint, rank),
                    connect=s.kv_events_connect,
                )
                self._publishers[rank] = publisher
                self._tasks.append(asyncio.create_task(publisher.serve_replay()))
            self._tasks.append(asyncio.create_task(self._loop(rank)))

    async def _stop(self, _: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for publisher in self._publishers:
            if publisher is not None:
                publisher.close()

    # --- the engine loop -----------------------------------------------------------------
    async def _loop(self, rank: int) -> None:
        loop = asyncio.get_running_loop()
        core, wake = self.cores[rank], self._wakes[rank]
        while True:
            if core.idle:
                wake.clear()
                await self._publish_events(rank)
                await wake.wait()
            started = loop.time()
            result = core.step(time.time())
            await self._publish_events(rank)
            # sleep the rest of the simulated step (our own bookkeeping time counts towards it)
            await asyncio.sleep(max(0.0, result.duration_s - (loop.time() - started)))
            for seq, tok in result.tokens:
                q = self._queues.get(seq.request_id)
                if q is not None:
                    q.put_nowait(tok)
            for seq in result.finished:
                q = self._queues.get(seq.request_id)
                if q is not None:
                    q.put_nowait(_DONE)

    async def _publish_events(self, rank: int) -> None:
        events = self.cores[rank].drain_events()
        publisher = self._publishers[rank]
        if events and publisher is not None:
            await publisher.publish(
                encode_batch(
                    events,
                    self.settings.profile.block_size,
                    shape=self.settings.kv_events_shape,
                    data_parallel_rank=rank,
                    lora_ids=self._lora_ids,
                )
            )

    def _rank_for(self, request: web.Request) -> int | web.Response:
        """The rank named by ``X-data-parallel-rank`` (vLLM's header), else the least loaded
        (vLLM's internal balancing scores waiting requests 4× running ones)."""
        named = request.headers.get("X-data-parallel-rank")
        if named is not None:
            if not named.isdigit() or int(named) >= len(self.cores):
                msg = f"X-data-parallel-rank must be 0..{len(self.cores) - 1}"
                return _json(error_body(msg), 400)
            return int(named)
        loads = [4 * len(c.waiting) + len(c.running) for c in self.cores]
        return loads.index(min(loads))

    # --- HTTP ----------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, CompletionRequest)
        if isinstance(body, web.Response):
            return body
        assert isinstance(body, CompletionRequest)
        prompts = body.prompt_list(self.tokenization.encode_prompt)
        if len(prompts) > 1:
            return await self._serve_batch(request, body, prompts)
        return await self._serve(request, body, prompts[0], "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._parse(request, ChatRequest)
        if isinstance(body, web.Response):
            return body
        assert isinstance(body, ChatRequest)
        return await self._serve(request, body, self.tokenization.encode_chat(body), "chat")

    async def _agent(self, request: web.Request, api: Api) -> web.StreamResponse:
        """Anthropic's Messages or OpenAI's Responses API: made a chat, as vLLM makes them
        (streams/agentapis.py), answered in the API's own shape (agents/simformats.py)."""
        parsed: MessagesRequest | ResponsesRequest | web.Response = (
            await self._parse(request, MessagesRequest)
            if api == "messages"
            else await self._parse(request, ResponsesRequest)
        )
        if isinstance(parsed, web.Response):
            return parsed
        try:
            chat = parsed.to_chat()
            tokens = self.tokenization.encode_chat(chat)
        except ValueError as exc:
            return _json(error_body(str(exc).splitlines()[0]), 400)
        return await self._serve(request, chat, tokens, api, parsed.stream)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._agent(request, "messages")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._agent(request, "responses")

    async def _parse(self, request: web.Request, model: type[_Body]) -> _Body | web.Response:
        try:
            body = model.model_validate_json(await request.read())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return _json(error_body(f"{where}: {first['msg']}"), 400)
        if body.model != self.settings.served_model_name and body.model not in self._lora_ids:
            return _json(
                error_body(f"The model `{body.model}` does not exist.", "NotFoundError", 404), 404
            )
        return body

    def _submit(
        self,
        rank: int,
        tokens: list[int],
        body: CompletionRequest | ChatRequest,
        rid: str,
        add: bool = True,
    ) -> tuple[Sequence, asyncio.Queue[object]]:
        """A sequence for ``tokens`` on engine core ``rank``; its tokens arrive on the queue
        (``add`` False: the caller adds it to the core)."""
        seq = Sequence(
            rid,
            tokens,
            body.output_limit(self.settings.default_max_tokens),
            time.time(),
            random.Random(self._rng.random()),
            lora=body.model if body.model in self._lora_ids else None,
            cache_salt=body.cache_salt,
            retain_s=retention_ttl(body.model_extra),
        )
        seq.salt = first_salt(tokens, (body.model_extra or {}).get("seed"), seq.salt)
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._queues[rid] = queue
        if add:
            self.cores[rank].add(seq)
            self._wakes[rank].set()
        return seq, queue

    async def _serve_batch(
        self, request: web.Request, body: CompletionRequest, prompts: list[list[int]]
    ) -> web.StreamResponse:
        """A batched completion (vLLM: one choice per prompt), on one engine core. The
        simulated engine answers batches whole; it streams one prompt per request."""
        if body.stream:
            return _json(error_body("the simulated engine streams one prompt per request"), 400)
        rank = self._rank_for(request)
        if isinstance(rank, web.Response):
            return rank
        if any(not p or not self.cores[rank].fits(len(p)) for p in prompts):
            return _json(error_body("a prompt is empty or exceeds the KV cache"), 400)
        rid = "cmpl-" + uuid.uuid4().hex
        subs = [self._submit(rank, p, body, f"{rid}-{i}") for i, p in enumerate(prompts)]

        async def collect(queue: asyncio.Queue[object]) -> list[int]:
            return [t async for t in _drain(queue)]

        try:
            outs = await asyncio.gather(*(collect(q) for _, q in subs))
            usages = [_usage(seq) for seq, _ in subs]
            cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
            usage = {
                "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
                "completion_tokens": sum(u["completion_tokens"] for u in usages),
                "total_tokens": sum(u["total_tokens"] for u in usages),
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            choices = [
                {"index": i, "text": self.tokenization.decode(out), "finish_reason": "length"}
                for i, out in enumerate(outs)
            ]
            return _json(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": int(subs[0][0].arrival_s),
                    "model": body.model,
                    "choices": choices,
                    "usage": usage,
                }
            )
        finally:
            for seq, _ in subs:
                self._queues.pop(seq.request_id, None)
                self.cores[rank].abort(seq)

    async def _serve(
        self,
        request: web.Request,
        body: CompletionRequest | ChatRequest,
        tokens: list[int],
        api: Api,
        stream: bool | None = None,
    ) -> web.StreamResponse:
        """Generate for ``tokens`` and answer in ``api``'s shape (``stream``: the agent APIs'
        own flag; ``body`` is then the chat the engine made of the request)."""
        if not tokens:
            return _json(error_body("prompt is empty"), 400)
        rank = self._rank_for(request)
        if isinstance(rank, web.Response):
            return rank
        core = self.cores[rank]
        if not core.fits(len(tokens)):
            return _json(
                error_body(
                    f"prompt of {len(tokens)} tokens exceeds the KV cache "
                    f"({core.cache.num_blocks} blocks of {self.settings.profile.block_size})"
                ),
                400,
            )
        rid = AnswerFormat.request_id(api, uuid.uuid4().hex)
        transfer = transfer_params(self.settings, body)
        seq, queue = self._submit(rank, tokens, body, rid, add=False)
        if transfer is not None and transfer.get("do_remote_prefill"):
            try:
                await receive(self.settings, self.cores[rank], seq, transfer)
            except BaseException:
                self._queues.pop(rid, None)
                raise
        self.cores[rank].add(seq)
        self._wakes[rank].set()
        usage_asked = bool(body.stream_options and body.stream_options.include_usage)
        fmt = AnswerFormat(api, rid, int(seq.arrival_s), body.model, usage_asked)
        try:
            if body.stream if stream is None else stream:
                try:
                    return await self._stream(request, seq, queue, fmt)
                except (ConnectionResetError, ClientConnectionResetError):
                    log.info("client left %s after %d tokens", rid, len(seq.output))
                    return web.Response(status=499)
            out: list[int] = [t async for t in _drain(queue)]
            answer = fmt.whole(self.tokenization.decode(out), _usage(seq))
            if transfer is not None and transfer.get("do_remote_decode"):
                answer["kv_transfer_params"] = exported(
                    self.settings, f"{self.engine_id}-dp{rank}", seq, request
                )
            return _json(answer)
        finally:
            self._queues.pop(rid, None)
            core.abort(seq)  # no-op when finished; frees blocks when the client left

    async def _stream(
        self,
        request: web.Request,
        seq: Sequence,
        queue: asyncio.Queue[object],
        fmt: AnswerFormat,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        self._streaming[id(request)] = request
        try:
            await self._relay(resp, seq, queue, fmt)
        finally:
            self._streaming.pop(id(request), None)
        return resp

    async def _relay(
        self,
        resp: web.StreamResponse,
        seq: Sequence,
        queue: asyncio.Queue[object],
        fmt: AnswerFormat,
    ) -> None:
        first = True
        async for tok in _drain(queue):
            if first:
                opening = fmt.start(len(seq.prompt), seq.cached_tokens)
                if opening:
                    await resp.write(opening)
            await resp.write(fmt.piece(self.tokenization.decode([tok]), first))
            first = False
        await resp.write(fmt.end(_usage(seq)))
        await resp.write_eof()

    async def _models(self, _: web.Request) -> web.Response:
        max_len = self.core.cache.num_blocks * self.settings.profile.block_size
        return _json(model_listing(self.settings, max_len, self.started_s))

    async def _server_info(self, _: web.Request) -> web.Response:
        return _json(server_info(self.settings))

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: a completion prompt or chat messages → token ids."""
        try:
            tokens = tokenize(self.tokenization, await request.read())
        except ValueError as exc:  # (orjson's and pydantic's errors are ValueErrors)
            return _json(error_body(str(exc).splitlines()[0]), 400)
        max_len = self.core.cache.num_blocks * self.settings.profile.block_size
        return _json({"count": len(tokens), "max_model_len": max_len, "tokens": tokens})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, _: web.Request) -> web.Response:
        sglang = self.settings.metrics_format == "sglang"
        render = render_sglang_metrics if sglang else render_metrics
        body = render(self.cores, self.settings.served_model_name, self.started_s)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _reset(self, _: web.Request) -> web.Response:
        ok = True
        for rank, core in enumerate(self.cores):
            ok = core.cache.clear() and ok
            await self._publish_events(rank)
        return _json({"reset": ok}, 200 if ok else 409)


async def _drain(queue: asyncio.Queue[object]) -> AsyncIterator[int]:
    while True:
        item = await queue.get()
        if item is _DONE:
            return
        assert isinstance(item, int)
        yield item


def _usage(seq: Sequence) -> dict[str, Any]:
    return {
        "prompt_tokens": len(seq.prompt),
        "completion_tokens": len(seq.output),
        "total_tokens": seq.tokens,
        "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
    }
