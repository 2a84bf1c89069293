"""Each served model's tokenizer, found rather than configured (streams/tokenizerfind.py).

Heartbeats say what each engine serves its model from (``model_source``). For a model with no
tokenizer in ``router.tokenizers``, the router looks that source up once (a folder of
``router.tokenizer_dirs``, the Hugging Face cache), loads the tokenizer once per process (never a
copy of it: streams/tokenization.py) and tokenizes the model's requests with it from then on; the
token checks (router/http/probes.py) compare it with the engine's own ``/tokenize`` like a
configured one and set it aside when it differs. Not found: the model stays approximate and the
router routes on its own memory of where it sent each prompt (router/decision/recent.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Literal

from router.settings import RouterSettings
from streams.schemas import Heartbeat
from streams.tokenization import Tokenization, load_tokenization
from streams.tokenizerfind import find_tokenizer

__all__ = ["TokenizerDiscovery"]

log = logging.getLogger(__name__)

MAX_MODELS = 256  # models looked up at most (each at most once per source)


class TokenizerDiscovery:
    """Which models to look up, and the lookup itself (blocking: run it in a thread)."""

    def __init__(self, settings: RouterSettings, tokenizations: dict[str, Tokenization]) -> None:
        self.settings = settings
        self.tokenizations = tokenizations  # the intake's: a found tokenizer goes in there
        self.configured = frozenset(settings.tokenizers)
        self.tried: dict[tuple[str, str], Literal["found", "not found", "failed"]] = {}

    def due(self, heartbeats: Iterable[Heartbeat]) -> list[tuple[str, str]]:
        """(model, source) pairs to look up: models without a tokenizer, sources not tried."""
        if not self.settings.tokenizer_discovery:
            return []
        out = []
        for hb in heartbeats:
            key = (hb.model, hb.model_source or "")
            if (
                hb.model_source
                and hb.model not in self.tokenizations
                and key not in self.tried
                and len(self.tried) < MAX_MODELS
                and key not in out
            ):
                out.append(key)
        return out

    def look_up(self, model: str, source: str) -> Tokenization | None:
        """Find and load ``model``'s tokenizer from ``source`` (blocking: files, parsing)."""
        key = (model, source)
        try:
            spec = find_tokenizer(source, self.settings.tokenizer_dirs)
            if spec is None:
                self.tried[key] = "not found"
                log.info(
                    "no tokenizer for %s (%s) here: its tokens stay approximate", model, source
                )
                return None
            tokenization = load_tokenization(spec)
        except (ValueError, OSError) as exc:
            self.tried[key] = "failed"
            log.warning("tokenizer of %s from %s unusable: %s", model, source, exc)
            return None
        self.tried[key] = "found"
        log.info("tokenizer of %s found from %s: %s", model, source, spec.tokenizer)
        return tokenization

    def install(self, model: str, tokenization: Tokenization) -> None:
        """``model``'s requests are tokenized with it from now on (unless one is configured)."""
        if model not in self.configured:
            self.tokenizations[model] = tokenization

    def report(self) -> dict[str, str]:
        """model → configured, or what the lookup of each source found."""
        out = {m: "configured" for m in sorted(self.configured)}
        for (model, source), outcome in sorted(self.tried.items()):
            out.setdefault(model, f"{outcome}: {source}")
        return out
