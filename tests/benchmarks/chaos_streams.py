"""Chaos scenarios of streams in flight (tests/benchmarks/chaos.py runs them beside the
well-behaved load): their engine dies, or is drained, while 50+ streams run.

``engine_killed_mid_stream``: 60 streamed requests (chat and completions, each with a seed) run;
once every one has its first tokens, the engine serving most of them (the victim) is killed -9.
Its streams go on from the other engine (router.stream_resumes). ``drain_mid_stream``: the same
load, and the victim is drained (``kvgate drain``) instead: after ``router.drain_grace_s`` (2 s
here) its streams are moved rather than waited for.

Per scenario: ``streams``, ``affected`` (streams that began on the victim), ``affected_whole`` (of
those, how many reached the client with all their tokens, one id, one usage block counting the
whole answer, no error event, and exactly the text of the same request — same seed — run
uninterrupted on an engine afterwards), ``whole_share`` (affected_whole / affected),
``duplicated_or_missing`` (affected streams whose text differs from that run), ``others_whole``
(the streams that stayed where they were). The drain also reports ``victim_idle_after_s`` (from
the drain to the victim running nothing).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp

from tests.ssekit import note_event, stream_record

if TYPE_CHECKING:
    from tests.benchmarks.chaos import Chaos, Load

MODEL = "llama-3.1-8b"
KEY = "sk-streams"  # a tenant of its own (the well-behaved load's tenants are not squeezed)
STREAMS = 60
TOKENS = 500


def _body(i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": TOKENS,
        "stream": True,
        "seed": 7000 + i,
        "stream_options": {"include_usage": True},
    }
    prompt = f"[stream {i}] summarise the state of the cluster " * 12
    if i % 2:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _read(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    started: asyncio.Event | None = None,
    got: dict[str, Any] | None = None,
) -> dict[str, Any]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    got = stream_record() if got is None else got
    try:
        async with http.post(
            url + path,
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=aiohttp.ClientTimeout(total=180),
        ) as r:
            got["status"] = r.status
            got["node"] = r.headers.get("X-Kvgate-Node")
            async for line in r.content:
                note_event(got, line)
                if started is not None and len(got["text"]) >= 5:
                    started.set()
    except (aiohttp.ClientError, TimeoutError) as exc:
        got["errors"] += 1
        got["exception"] = repr(exc)
    return got


def _whole(got: dict[str, Any], want: dict[str, Any]) -> bool:
    usage = got["usage"]
    return (
        got.get("status") == 200
        and got["errors"] == 0
        and len(got["ids"]) == 1
        and len(got["text"]) == TOKENS
        and len(usage) == 1
        and usage[0].get("completion_tokens") == TOKENS
        and "".join(got["text"]) == "".join(want["text"])
    )


async def _running(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.split()[-1])
    return 0.0


async def _streams_hit(
    chaos: Chaos, event: Callable[[str], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """Run the streams; once each has its first tokens, call ``event`` on the node serving
    most of them (the victim); check every stream."""
    bodies = [_body(i) for i in range(STREAMS)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        starts = [asyncio.Event() for _ in bodies]
        gots = [stream_record() for _ in bodies]
        calls = [
            asyncio.create_task(_read(http, chaos.router, b, s, g))
            for b, s, g in zip(bodies, starts, gots, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
        on = Counter(g["node"] for g in gots)
        victim = max(("n1", "n2"), key=lambda n: on[n])
        extra = {"victim": victim, "streams_on_victim": on[victim], **await event(victim)}
        results = await asyncio.gather(*calls)
        # the same requests, uninterrupted, on the engine left
        survivor = chaos.nodes["n2" if victim == "n1" else "n1"]
        wants = []
        for i in range(0, STREAMS, 20):
            batch = bodies[i : i + 20]
            wants += await asyncio.gather(*(_read(http, survivor, b, None) for b in batch))
    affected = [(g, w) for g, w in zip(results, wants, strict=True) if g["node"] == victim]
    others = [(g, w) for g, w in zip(results, wants, strict=True) if g["node"] != victim]
    whole = sum(_whole(g, w) for g, w in affected)
    differs = sum("".join(g["text"]) != "".join(w["text"]) for g, w in affected)
    return {
        "streams": STREAMS,
        "tokens_per_stream": TOKENS,
        "affected": len(affected),
        "affected_whole": whole,
        "whole_share": round(whole / max(1, len(affected)), 4),
        "duplicated_or_missing": differs,
        "others_whole": sum(_whole(g, w) for g, w in others),
        "others": len(others),
        **extra,
    }


async def engine_killed_mid_stream(chaos: Chaos, load: Load) -> dict[str, Any]:
    killed: list[tuple[str, list[str]]] = []

    async def kill(node: str) -> dict[str, Any]:
        running = await _running(chaos.nodes[node])
        name = f"engine-{node}"
        killed.append((name, [str(a) for a in chaos.sup.procs[name].popen.args]))  # type: ignore[union-attr]
        chaos.sup.kill(name)
        return {"victim_running_when_killed": running}

    out = await _streams_hit(chaos, kill)
    for name, argv in killed:  # (the scenarios after it have two engines)
        chaos.sup.spawn_argv(name, argv)
    return out


async def drain_mid_stream(chaos: Chaos, load: Load) -> dict[str, Any]:
    env = {**os.environ, **chaos.sup.env}

    def kvgate(*argv: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "deploy", *argv], env=env, check=True, capture_output=True
        )

    drained: list[str] = []

    async def drain(node: str) -> dict[str, Any]:
        running = await _running(chaos.nodes[node])
        t0 = time.monotonic()
        await asyncio.to_thread(kvgate, "drain", node)
        drained.append(node)
        while await _running(chaos.nodes[node]) and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.2)
        return {
            "victim_running_when_drained": running,
            "victim_idle_after_s": round(time.monotonic() - t0, 2),
        }

    out = await _streams_hit(chaos, drain)
    for node in drained:
        await asyncio.to_thread(kvgate, "undrain", node)
    return out


STREAM_SCENARIOS: dict[str, Callable[[Chaos, Load], Awaitable[dict[str, Any]]]] = {
    "engine_killed_mid_stream": engine_killed_mid_stream,
    "drain_mid_stream": drain_mid_stream,
}
