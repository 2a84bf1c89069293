"""What the in-flight ledger (router/decision/inflight.py) keeps: one record per request, per
node and per group of nodes sharing a prefill rate."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = ["LedgerEntry", "NodeRecord", "RatePool"]


@dataclass(slots=True)
class LedgerEntry:
    node: NodeRecord
    dispatched_s: float
    prefill_tokens: int
    prefilling: bool = True
    expected_output: int = 0
    long_blocks: int = 0
    first_token_s: float | None = None
    hashes: tuple[int, ...] = ()  # its prompt blocks (with track_blocks)
    pending: tuple[int, ...] = ()  # its prompt blocks among the pending prefixes
    ahead: int = 0  # this router's prefill backlog on the node when it was dispatched


@dataclass(slots=True)
class RatePool:
    """The nodes of one group (a model) with a learned prefill rate, and the sum of the rates;
    the same for the rates their agents reported."""

    known: int = 0
    rates: float = 0.0
    reporting: int = 0
    reported: float = 0.0
    version: int = 0  # moves whenever the pool's rate may have (``InflightLedger.view``)

    def rate(self) -> float:
        """Learned, else reported, else 0 (unknown)."""
        if self.known:
            return self.rates / self.known
        return self.reported / self.reporting if self.reporting else 0.0


@dataclass(slots=True)
class NodeRecord:
    """Everything the ledger keeps for one node, in one place: the decision's per-node loop
    (``InflightLedger.router_state``) makes one dictionary lookup per node."""

    name: str
    pool: RatePool
    group: str = ""
    recent: deque[tuple[float, str]] = field(default_factory=deque)  # (dispatched, request)
    count: int = 0  # requests in flight
    backlog: int = 0
    long_blocks: int = 0
    # expected output of every request in flight; decoding requests and the sum of their
    # first-token times (the decode they did so far is (count · now − sum) / tpot)
    expected: int = 0
    decoding: int = 0
    first_sum: float = 0.0
    tpot: float | None = None  # observed s per output token
    prefill_rate: float = 0.0  # observed prompt tokens/s, and how many samples taught it
    prefill_samples: int = 0
    reported_rate: float = 0.0  # what its agent measured (0: nothing reported)
    blocks: Counter[int] | None = None  # block -> holders (with track_blocks)
    version: int = 0  # moves whenever what router_state reads of it may have
