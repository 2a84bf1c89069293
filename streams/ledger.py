"""The KV ledger: which reservations are open, folded from ``kvgate.ledger``.

:class:`LedgerBook` is the pure fold (the worker's ``kv_ledger`` table holds the same state: one
entry per open reservation, its ``reserve`` event). A ``reserve`` opens an entry, a ``release``
or ``expire`` closes it, a ``renew`` moves its lease; all are idempotent, so a replay after a
crash folds to the same book.
The book also remembers for a while which reservations closed, so a reconciler can tell "closed
a moment ago" from "never seen".

:class:`LedgerReplica` keeps a book in a router: bootstrapped from the worker's table, then
following the topic itself (no waiting for the worker's commits).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field

from streams.replica import TablesThenInput
from streams.schemas import LedgerEvent
from streams.settings import KafkaSettings, WorkerSettings
from streams.tables import KV_LEDGER, app_id
from streams.topics import LEDGER

__all__ = ["LedgerBook", "LedgerReplica", "ledger_fold"]


def ledger_fold(event: LedgerEvent, current: LedgerEvent | None) -> LedgerEvent | None:
    """The reservation's ledger entry after ``event`` (None: closed). ``reserve`` opens it,
    ``release`` / ``expire`` close it, ``renew`` moves an open entry's lease (a renew of a
    closed reservation reopens nothing)."""
    if event.kind == "reserve":
        return event
    if event.kind == "renew":
        if current is None:
            return None
        return current.model_copy(update={"lease_expires_at": event.lease_expires_at})
    return None


@dataclass(slots=True)
class LedgerBook:
    closed_memory_s: float = 600.0
    open: dict[str, LedgerEvent] = field(default_factory=dict)
    closed: OrderedDict[str, float] = field(default_factory=OrderedDict)  # id -> when closed

    def apply(self, event: LedgerEvent, now: float) -> None:
        rid = event.reservation_id
        entry = ledger_fold(event, self.open.get(rid))
        if entry is not None:
            self.open[rid] = entry
            self.closed.pop(rid, None)
            return
        if event.kind == "renew":  # of a reservation closed already: nothing changes
            return
        self.open.pop(rid, None)
        self.closed[rid] = now
        self.closed.move_to_end(rid)
        self.forget_closed(now)

    def set_entry(self, rid: str, event: LedgerEvent | None, now: float) -> None:
        """A table entry (None: a tombstone, the reservation closed)."""
        if event is None:
            self.open.pop(rid, None)
            self.closed[rid] = now
            self.closed.move_to_end(rid)
        else:
            self.open[rid] = event
            self.closed.pop(rid, None)

    def forget_closed(self, now: float) -> None:
        while self.closed:
            at = next(iter(self.closed.values()))
            if now - at <= self.closed_memory_s:
                break
            self.closed.popitem(last=False)

    def held(self, pool: str) -> tuple[int, int]:
        """Blocks and slots the open reservations of ``pool`` hold."""
        blocks = slots = 0
        for e in self.open.values():
            if e.pool == pool:
                blocks += e.kv_blocks
                slots += e.slots
        return blocks, slots


class LedgerReplica(TablesThenInput):
    def __init__(
        self, kafka: KafkaSettings, worker: WorkerSettings, client_id: str, **kw: bool
    ) -> None:
        self.table_topic = KV_LEDGER.changelog(app_id(kafka, worker))
        self.ledger_topic = LEDGER.name(kafka.namespace)
        super().__init__(kafka, worker, client_id, (self.table_topic,), (self.ledger_topic,), **kw)
        self.book = LedgerBook()
        self.writers: dict[str, float] = {}  # router id -> its newest ledger event (live input)

    def _reset(self) -> None:
        # a rebuild (a start, or after losing Kafka) reads the ledger again: until it is caught
        # up, the book is not the ledger (the reconciler waits)
        self.book = LedgerBook(self.book.closed_memory_s)
        self.caught_up.clear()

    def _describe(self) -> str:
        return f"{len(self.book.open)} open reservations"

    def _apply_changelog(
        self, topic: str, key: bytes | None, value: bytes | None, now: float
    ) -> None:
        if key is None:
            return
        self.records += 1
        if value is None:
            self.book.set_entry(key.decode(), None, now)
            return
        with contextlib.suppress(ValueError):
            self.book.set_entry(key.decode(), LedgerEvent.model_validate_json(value), now)

    def _apply_input(self, topic: str, key: bytes | None, value: bytes | None, now: float) -> None:
        if value is None:
            return
        self.records += 1
        with contextlib.suppress(ValueError):  # invalid input: the worker dead-letters it
            event = LedgerEvent.model_validate_json(value)
            self.book.apply(event, now)
            if event.ts > self.writers.get(event.router_id, 0.0):
                self.writers[event.router_id] = event.ts

    def _tick(self, now: float) -> None:
        self.book.forget_closed(now)
