"""What the stream relay costs per chunk, in process: the proxy's SSE reader
(``router/http/sse.py`` ``SseLines``) fed a vLLM-shaped chat stream, without and with the
mid-stream failover trail (``router/http/resume.py`` ``Trail``: what the client was sent, kept
so that a broken stream can go on from another node). CPU microseconds per chunk, the trail's
ratio to the bare relay in the same repetition, median and spread.

    python -m tests.benchmarks.relay [--chunks 512] [--repeat 31]

Writes ``docs/benchmarks/relay.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import orjson

from router.flow.served import Served
from router.http.resume import Trail
from router.http.sse import SseLines
from router.parse import parse_request

OUT = Path("docs/benchmarks/relay.json")


def _chunk(i: int) -> bytes:
    c = {
        "id": "chatcmpl-0123456789abcdef",
        "object": "chat.completion.chunk",
        "created": 1796342846,
        "model": "llama-3.1-8b",
        "choices": [
            {"index": 0, "delta": {"content": f" tok{i}"}, "logprobs": None, "finish_reason": None}
        ],
    }
    return b"data: " + orjson.dumps(c) + b"\n\n"


def _per_chunk_us(chunks: list[bytes], trail: bool) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    p = parse_request(orjson.dumps(body), True, 256)
    lines = SseLines(Served(), True, None, time.time(), None, Trail(p) if trail else None)
    t = time.process_time()
    for c in chunks:
        lines.feed(c)
    return (time.process_time() - t) / len(chunks) * 1e6


def run(chunks: int, repeat: int) -> dict[str, Any]:
    stream = [_chunk(i) for i in range(chunks)] * 20  # long enough for process_time's clock
    bare, trail = [], []
    for _ in range(repeat):
        bare.append(_per_chunk_us(stream, False))
        trail.append(_per_chunk_us(stream, True))
    ratios = sorted(t / b for b, t in zip(bare, trail, strict=True))
    return {
        "command": f"python -m tests.benchmarks.relay --chunks {chunks} --repeat {repeat}",
        "machine": f"{platform.machine()}, Python {platform.python_version()}",
        "chunks_per_stream": chunks,
        "repetitions": repeat,
        "relay_us_per_chunk_median": round(statistics.median(bare), 3),
        "relay_with_trail_us_per_chunk_median": round(statistics.median(trail), 3),
        "trail_us_per_chunk_median": round(statistics.median(trail) - statistics.median(bare), 3),
        "trail_ratio_median": round(statistics.median(ratios), 3),
        "trail_ratio_spread": [round(ratios[0], 3), round(ratios[-1], 3)],
        "trail_ms_per_stream_median": round(
            (statistics.median(trail) - statistics.median(bare)) * chunks / 1000, 3
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=31)
    args = ap.parse_args()
    result = run(args.chunks, args.repeat)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
