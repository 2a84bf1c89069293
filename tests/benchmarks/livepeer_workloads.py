"""The live comparison's workloads and what every peer benchmark shares (the model name, the
report's head): tests/benchmarks/livepeer.py runs them, livepeer_report.py writes them."""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analytics.sim.metrics import pct
from tests.benchmarks.liveagentic import AgenticLive

__all__ = [
    "ENGINE_TOKENIZER",
    "EVENTS_OFF",
    "MODEL",
    "OUT",
    "SGLANG_TUNED",
    "SGLANG_TUNED_NAME",
    "WORKLOADS",
    "Workload",
    "pct",  # the percentile the peer benchmarks report (analytics/sim/metrics.py)
    "report_header",
]

OUT = Path("docs/benchmarks")
MODEL = "llama-3.1-8b"


@dataclass(frozen=True)
class Workload:
    rps: float
    duration_s: float
    bots: int
    system_words: int
    num_gpu_blocks: int
    prefill_tokens_per_s: float | None  # None: the engine profile's (25,000 tokens/s)
    about: str
    # the engines tokenize with a real tokenizer (a BPE vocabulary) that kvgate is not given:
    # its tokens are approximate; it runs with the agents' KV events and again without them
    engine_tokenizer: bool = False
    # coding-agent sessions in closed loop (tests/benchmarks/liveagentic.py) instead of the chat;
    # ``duration_s`` is how long new turns start
    agentic: AgenticLive | None = None


WORKLOADS = {
    "easy": Workload(20.0, 40.0, 40, 600, 1200, None, "full-speed engines, both routers keep up"),
    "loaded": Workload(
        24.0,
        60.0,
        16,
        1500,
        1200,
        2000.0,
        "slow prefill: a miss costs ~1 s of an engine; near saturation even when prompts hit",
    ),
    "approx": Workload(
        20.0,
        40.0,
        40,
        600,
        1200,
        None,
        "engines tokenize with a BPE vocabulary kvgate is not given (approximate tokens), with "
        "the agents' KV events flowing and switched off, in turn",
        engine_tokenizer=True,
    ),
    "agentic": Workload(
        0.0,
        120.0,
        0,
        0,
        1600,
        2000.0,
        "coding-agent sessions (AIPerf's agentic trace, scaled down), 16 at once in closed loop "
        "on engines that hold a few contexts each",
        agentic=AgenticLive(),
    ),
}
# the engines' tokenizer in the approx workload (a real BPE tokenizer.json, shipped inside the
# anthropic package: nothing is downloaded); the router is given none and finds none
ENGINE_TOKENIZER = {"tokenizer": "package:anthropic/tokenizer.json"}
EVENTS_OFF = "kvgate_events_off"
# sglang-router tuned for a few sessions at once (agentic): its defaults balance load only when
# two workers are more than 64 requests apart (and 1.5x), so with 16 sessions every one follows
# the shared system prompt to the same worker
SGLANG_TUNED_NAME = "sglang_router_tuned"
SGLANG_TUNED = ("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.5")


def report_header(module: str) -> dict[str, Any]:
    """Command, machine, date and the peer's version: the head of every peer benchmark file."""
    import importlib.metadata

    return {
        "command": f"python -m {module} " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "sglang_router_version": importlib.metadata.version("sglang-router"),
    }
