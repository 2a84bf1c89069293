"""The autoscaling signal: how many replicas a (pool, model) should have, ``desired_replicas``.

A new replica takes ``lead_time_s`` to load its model, so scaling on what is seen now is late by
that much on every ramp. :class:`Predictive` sizes the fleet for the traffic forecast one lead
time ahead (Holt's linear trend, or Holt-Winters with the season once two seasons of history
exist: statsmodels), never below what the present needs, and adds a replica at once when the
fleet shows pressure (queued requests per replica, KV use, admission refusals). It scales down
only after the lower size has held for ``scale_down_delay_s``, one replica per interval
(hysteresis: a dip between two peaks does not cost a model load).

:class:`Reactive` is the usual queue-threshold scaler, kept as the baseline: one more replica
when requests queue (or KV fills, or admission refuses), one fewer when nothing queues and one
fewer replica would still carry the arrival rate, held for ``scale_down_delay_s``.

Both are pure: fed one :class:`Observation` per ``interval_s``, they return the desired count.
The simulator (``analytics.sim.cluster``, ``SimConfig.autoscaler``) closes the loop in virtual
time; ``kvgate autoscale`` runs one on the live load table.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_SEASON_INTERVALS",
    "AutoscaleSettings",
    "Autoscaler",
    "Observation",
    "Predictive",
    "Reactive",
    "forecast",
    "history_intervals",
    "make_autoscaler",
]


class AutoscaleSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    mode: Literal["predictive", "reactive"] = "predictive"
    interval_s: float = Field(default=30.0, gt=0, le=3600, description="one decision per")
    lead_time_s: float = Field(
        default=120.0,
        ge=0,
        le=7200,
        description="a new replica's time from the decision to serving (the forecast looks this "
        "far ahead): its model load; with a machine to provision first, that too",
    )
    replica_rps: float = Field(
        default=5.0, gt=0, description="requests/s one replica serves within the SLO (kvgate plan)"
    )
    target_utilization: float = Field(
        default=0.85, gt=0, le=1, description="of replica_rps at the forecast peak"
    )
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=64, ge=1)
    scale_down_delay_s: float = Field(
        default=600.0, ge=0, description="a lower size must hold this long before scaling down"
    )
    history_s: float = Field(
        default=1800.0, gt=0, description="arrival history the trend is fitted on"
    )
    season_s: float = Field(
        default=86400.0, gt=0, description="seasonality (used once two seasons are seen)"
    )
    queue_per_replica_high: float = Field(
        default=4.0, gt=0, description="queued requests per replica that add one at once"
    )
    kv_high: float = Field(default=0.92, gt=0, le=1, description="mean KV use that adds one")
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(
        default=9108, ge=0, le=65535, description="kvgate autoscale's /metrics (None: off)"
    )
    history_from_clickhouse: bool = Field(
        default=True, description="on start, rebuild the arrival history from the decision log"
    )
    history_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="longest wait for that history before starting"
    )


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval of a pool: what arrived, what waits, what runs."""

    now: float
    replicas: int  # serving now
    arrivals: int  # requests that arrived in the interval
    waiting: int  # requests queued (engines and routers)
    running: int  # requests running on the engines
    kv_used: float  # mean KV use of the serving replicas (0–1)
    refusals: int = 0  # admission refusals in the interval


class Autoscaler(Protocol):
    settings: AutoscaleSettings

    def observe(self, obs: Observation) -> int: ...


# Holt-Winters' start-up costs grow with history × season: a day of 30 s intervals (2,880)
# takes ~0.2 s, 8,000 over a second; a longer season (e.g. a day of 2 s intervals) is not fitted
# at all (the trend alone), so a decision never stalls the service's loop.
MAX_SEASON_INTERVALS = 4096


def forecast(history: list[float], steps: int, season: int = 0) -> float:
    """The value ``steps`` intervals after the last of ``history`` (one value per interval):
    Holt's additive trend, with an additive season of ``season`` intervals once the history
    holds two (and the season is at most ``MAX_SEASON_INTERVALS`` long); never negative. Fixed
    smoothing (level 0.3, trend 0.05, season 0.1): refitting the parameters every interval
    would chase noise and costs 30× as much."""
    from statsmodels.tsa.holtwinters import ExponentialSmoothing

    if not history:
        return 0.0
    if len(history) < 4 or steps <= 0:
        return max(0.0, history[-1])
    seasonal = 2 <= season <= MAX_SEASON_INTERVALS and len(history) >= 2 * season
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # statsmodels' convergence and frequency notes
        model = ExponentialSmoothing(
            history,
            trend="add",
            seasonal="add" if seasonal else None,
            seasonal_periods=season if seasonal else None,
            initialization_method="heuristic" if len(history) >= 10 or seasonal else "known",
            initial_level=None if len(history) >= 10 or seasonal else history[0],
            initial_trend=None if len(history) >= 10 or seasonal else 0.0,
        )
        fit = model.fit(
            smoothing_level=0.3,
            smoothing_trend=0.05,
            smoothing_seasonal=0.1 if seasonal else None,
            optimized=False,
        )
        value = float(fit.forecast(steps)[-1])
    return max(0.0, value) if math.isfinite(value) else max(0.0, history[-1])


class _Hysteresis:
    """Up at once; down one step per interval once a lower target has held ``delay_s``."""

    def __init__(self, s: AutoscaleSettings, initial: int) -> None:
        self.s = s
        self.desired = initial
        self.lower_since: float | None = None

    def apply(self, target: int, now: float) -> int:
        s = self.s
        target = max(s.min_replicas, min(s.max_replicas, target))
        if target >= self.desired:
            self.lower_since = None
            self.desired = target
        else:
            if self.lower_since is None:
                self.lower_since = now
            if now - self.lower_since >= s.scale_down_delay_s:
                self.desired -= 1
        return self.desired


def history_intervals(s: AutoscaleSettings) -> int:
    """How many intervals of arrivals :class:`Predictive` keeps: its trend window, or two
    seasons and one interval (what Holt-Winters needs), whichever is longer."""
    window = int(s.history_s / s.interval_s)
    season = round(s.season_s / s.interval_s)
    return max(window, 2 * season + 1) if season <= MAX_SEASON_INTERVALS else window


class Predictive:
    """The forecast-driven scaler (module docstring)."""

    def __init__(self, settings: AutoscaleSettings, initial: int) -> None:
        self.settings = settings
        s = settings
        self.rates: deque[float] = deque(maxlen=history_intervals(s))
        self.hold = _Hysteresis(settings, initial)
        self.last_forecast_rps = 0.0

    def seed(self, rates: Sequence[float]) -> None:
        """Start from a recorded arrival history (requests/s per interval, oldest first), as if
        each had been observed: a restarted scaler keeps its trend and, with two seasons of
        record, its seasonality."""
        self.rates.extend(max(0.0, float(r)) for r in rates if math.isfinite(r))

    def observe(self, obs: Observation) -> int:
        s = self.settings
        rate = obs.arrivals / s.interval_s
        self.rates.append(rate)
        steps = max(1, math.ceil(s.lead_time_s / s.interval_s))
        season = round(s.season_s / s.interval_s)
        window = int(s.history_s / s.interval_s)
        history = list(self.rates)
        if len(history) < 2 * season:  # the trend alone, on the recent history
            history = history[-window:]
        ahead = forecast(history, steps, season)
        recent = sum(history[-3:]) / len(history[-3:])
        self.last_forecast_rps = ahead
        need = max(ahead, recent) / (s.replica_rps * s.target_utilization)
        target = math.ceil(need - 1e-9)
        if obs.replicas and (
            obs.waiting / obs.replicas > s.queue_per_replica_high
            or obs.kv_used > s.kv_high
            or obs.refusals > 0
        ):
            target = max(target, obs.replicas + 1)
        return self.hold.apply(target, obs.now)


class Reactive:
    """The queue-threshold baseline (module docstring)."""

    def __init__(self, settings: AutoscaleSettings, initial: int) -> None:
        self.settings = settings
        self.hold = _Hysteresis(settings, initial)

    def observe(self, obs: Observation) -> int:
        s = self.settings
        n = max(1, obs.replicas)
        target = self.hold.desired
        if (
            obs.waiting / n > s.queue_per_replica_high
            or obs.kv_used > s.kv_high
            or obs.refusals > 0
        ):
            target = self.hold.desired + 1
        elif obs.waiting == 0 and obs.arrivals / s.interval_s < (n - 1) * s.replica_rps * (
            s.target_utilization
        ):
            target = self.hold.desired - 1  # one fewer would still carry what arrives
        return self.hold.apply(target, obs.now)


def make_autoscaler(settings: AutoscaleSettings, initial: int) -> Autoscaler:
    if settings.mode == "reactive":
        return Reactive(settings, initial)
    return Predictive(settings, initial)
