"""A table recovery waiting for changelog records that were fetched and dropped is found, and
only then: a partition whose records keep arriving, one merely slow to fetch (nothing handed
out past what recovery received) and one restored are left alone."""

from __future__ import annotations

from streams.recoverywatch import RecoveryWatch, Restoring


def test_a_partition_handed_out_past_what_recovery_received_is_read_again_once_quiet() -> None:
    watch: RecoveryWatch[str] = RecoveryWatch(quiet_s=5.0)
    stalled = Restoring(received=-1, end=179, position=180)  # the consumer is at the end
    assert watch.check(0.0, {"p1": stalled}) == {}  # first look: quiet since now
    assert watch.check(4.9, {"p1": stalled}) == {}
    assert watch.check(5.0, {"p1": stalled}) == {"p1": 0}  # from its first record
    # read again: another quiet_s before it is named again
    assert watch.check(6.0, {"p1": stalled}) == {}
    assert watch.check(10.0, {"p1": stalled}) == {"p1": 0}


def test_the_offset_read_from_follows_what_recovery_received() -> None:
    watch: RecoveryWatch[str] = RecoveryWatch(quiet_s=1.0)
    part = Restoring(received=16, end=60, position=61)
    watch.check(0.0, {"p0": part})
    assert watch.check(1.0, {"p0": part}) == {"p0": 17}


def test_progress_slowness_and_the_end_are_not_stalls() -> None:
    watch: RecoveryWatch[str] = RecoveryWatch(quiet_s=1.0)
    for t in range(10):
        parts = {
            "arriving": Restoring(received=t, end=100, position=50),  # records keep arriving
            "slow": Restoring(received=3, end=100, position=4),  # nothing handed out past 3
            "unknown": Restoring(received=3, end=100, position=None),
            "restored": Restoring(received=100, end=100, position=101),
        }
        assert watch.check(float(t), parts) == {}


def test_a_partition_gone_from_the_recovery_is_forgotten() -> None:
    watch: RecoveryWatch[str] = RecoveryWatch(quiet_s=1.0)
    stalled = Restoring(received=-1, end=9, position=10)
    watch.check(0.0, {"p1": stalled})
    watch.check(0.5, {})  # a new recovery without it (or records queued: not looked at)
    assert watch.check(1.0, {"p1": stalled}) == {}  # quiet counts again from here
    assert watch.check(2.0, {"p1": stalled}) == {"p1": 0}
