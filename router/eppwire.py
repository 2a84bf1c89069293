"""The ext_proc wire of kvgate's endpoint picker (router/epp.py): the EPP protocol's names, the
request headers as a multidict, header mutations and immediate answers."""

from __future__ import annotations

from urllib.parse import urlsplit

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from router.flow.refusals import Refusal

__all__ = [
    "BUFFERED",
    "DESTINATION",
    "FULL_DUPLEX",
    "LB_NAMESPACE",
    "MAX_BODY_CHUNKS",
    "SERVED",
    "SUBSET",
    "SUBSET_NAMESPACE",
    "destination",
    "error_json",
    "header_map",
    "host_port",
    "immediate",
    "refused",
    "set_header",
]

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"  # the data plane's, on the response
LB_NAMESPACE = "envoy.lb"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
MAX_BODY_CHUNKS = 4096


def header_map(msg: ep.HttpHeaders) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for h in msg.headers.headers:
        out.add(h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
    return out


def host_port(endpoint: str) -> str:
    """``http://10.0.0.5:8000/`` → ``10.0.0.5:8000`` (the EPP protocol's ``ip:port``)."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(status: int, body: bytes, headers: dict[str, str]) -> ep.ProcessingResponse:
    """A refusal, answered by the gateway without reaching any engine."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ep.HeaderMutation(
                set_headers=[set_header("content-type", "application/json")]
                + [set_header(k.lower(), v) for k, v in headers.items()]
            ),
            body=body,
            details=f"kvgate_{status}",
        )
    )


def error_json(message: str, type_: str = "invalid_request_error") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None}})


def refused(r: Refusal) -> ep.ProcessingResponse:
    """A refusal, as the gateway's immediate answer (its status, body and Retry-After)."""
    headers = {k: v for k, v in r.headers.items() if k.lower() in ("retry-after", "retry-after-ms")}
    return immediate(r.status, r.body(), headers)


def destination(dest: str) -> struct_pb2.Struct:
    """The dynamic metadata that names the picked endpoint (``envoy.lb``)."""
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: dest}})
    return metadata
