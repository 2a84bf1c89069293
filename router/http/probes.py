"""Now and then, the engine tokenizes the same request (``POST /tokenize``): do its token ids
agree with kvgate's? The counts feed router/tokencheck.py, which marks a model's tokenization
approximate when too many disagree (the configured tokenizer or chat template is not the
engine's). Checks run beside the request, never in its way."""

from __future__ import annotations

import asyncio
import logging

from router.decision.types import NodeView
from router.flow.intake import IntakeReader
from router.http.upstream import Upstream
from router.metrics import RouterMetrics
from router.parse import ParsedRequest
from router.tokencheck import TokenCheck, engine_tokens, first_difference

__all__ = ["TokenChecks"]

log = logging.getLogger(__name__)


class TokenChecks:
    def __init__(
        self,
        upstream: Upstream,
        reader: IntakeReader,
        tokencheck: TokenCheck,
        metrics: RouterMetrics,
    ) -> None:
        self.upstream = upstream
        self.reader = reader
        self.tokencheck = tokencheck
        self.metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def check(self, node: NodeView, p: ParsedRequest) -> None:
        """``p`` was routed to ``node``: compare tokenizations, when one is due."""
        if not p.exact_tokens or p.model not in self.reader.tokenizations or p.other_prompt_tokens:
            return  # (a batch: the engine's /tokenize takes one prompt)
        if p.api is not None:  # the agent APIs: /tokenize takes chat or completion bodies only
            return
        if not self.tokencheck.due(p.model):
            return
        task = asyncio.create_task(self._compare(node, p))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _compare(self, node: NodeView, p: ParsedRequest) -> None:
        if not self.upstream.open:
            return
        http = self.upstream.session
        theirs = await engine_tokens(http, node.endpoint, p, headers=self.upstream.auth)
        if theirs is None:
            return  # the engine has no /tokenize (or refused): nothing learned
        matched = theirs == p.tokens
        self.metrics.token_checks.labels(p.model).inc()
        if not matched:
            self.metrics.token_mismatches.labels(p.model).inc()
            log.warning(
                "tokenization of %s differs from %s's from token %d (%d vs %d tokens)",
                p.model[:100],
                node.node_id,
                first_difference(theirs, p.tokens),
                len(p.tokens),
                len(theirs),
            )
        if self.tokencheck.record(p.model, matched):
            log.error(
                "tokenization of %s marked approximate: the configured tokenizer or chat "
                "template is not the engine's",
                p.model[:100],
            )
