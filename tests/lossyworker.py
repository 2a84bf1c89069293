"""``kvgate worker`` whose first table recovery loses the changelog records it was about to read.

    python -m tests.lossyworker worker [--config FILE]

Faust drops a batch it fetched when the batch returns while its flow is stopped (or after the
consumer generation changed) and seeks back only partitions with committed offsets, which
changelogs never have: the consumer's position then stands at the changelog's end while the
recovery waits for records it will never be handed. That depends on timing; this worker makes
it happen every time: after Faust seeks the changelog partitions it restores, the first time,
it moves their positions to their ends, as such a drop leaves them. The worker is otherwise the
real one (:mod:`streams.recoverywatch` must find the stall and read the records again).
"""

from __future__ import annotations

import sys
from typing import Any

from faust.tables.recovery import Recovery

from deploy.cli import main

_seek_offsets = Recovery._seek_offsets
_lost: set[Any] = set()


async def _seek_then_lose(
    self: Recovery, consumer: Any, tps: Any, offsets: Any, title: str
) -> None:
    await _seek_offsets(self, consumer, tps, offsets, title)
    if title != "active":
        return
    ends = await consumer.highwaters(*tps)
    lose = {tp: end for tp, end in ends.items() if end and tp not in _lost}
    if lose:
        _lost.update(lose)
        await consumer.seek_wait(lose)


Recovery._seek_offsets = _seek_then_lose  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv[0] = "kvgate"
    main()
