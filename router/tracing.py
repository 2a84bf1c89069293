"""Optional OpenTelemetry traces of the router's work (off unless ``router.otlp_endpoint`` is
set; needs the ``otel`` extra): one ``kvgate.request`` span per request, continuing the client's
W3C trace context, with ``kvgate.admission``, ``kvgate.route`` and ``kvgate.proxy`` children;
the engine then receives the proxy span's ``traceparent``. Spans leave in batches over OTLP/HTTP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["Tracing"]

_OFF: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()  # (reusable)


class Tracing:
    """Spans when tracing is on; cheap no-ops when it is off."""

    def __init__(
        self, endpoint: str | None, service_name: str, exporter: Any | None = None
    ) -> None:
        self.tracer: Any = None
        self._provider: Any = None
        if endpoint is None and exporter is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, timeout=5)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._provider.get_tracer("kvgate.router")

    @property
    def on(self) -> bool:
        return self.tracer is not None

    def span(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> contextlib.AbstractContextManager[Any]:
        """A span (the current one's child; ``headers``: continue the client's trace); with
        tracing off, one shared context that gives None (no generator made per request)."""
        if self.tracer is None:
            return _OFF
        return self._span(name, attributes, headers)

    @contextlib.contextmanager
    def _span(
        self, name: str, attributes: Mapping[str, Any] | None, headers: Mapping[str, str] | None
    ) -> Iterator[Any]:
        context = None
        if headers is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            context = TraceContextTextMapPropagator().extract(
                {
                    k.lower(): v
                    for k, v in headers.items()
                    if k.lower() in ("traceparent", "tracestate")
                }
            )
        attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
        with self.tracer.start_as_current_span(name, context=context, attributes=attrs) as span:
            yield span

    def inject(self) -> dict[str, str]:
        """The current span's W3C trace context, for the engine ({} when off)."""
        if self.tracer is None:
            return {}
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        return carrier

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
