"""Logging for kvgate's processes: text for people, or one JSON object per line for a log
pipeline (``kvgate --log-format json``)."""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

__all__ = ["JsonFormatter", "LogFormat", "configure"]

LogFormat = Literal["text", "json"]
NOISY = ("aiokafka", "faust", "mode", "aiohttp.access")


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message"}`` plus ``exc`` when there is a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "INFO", fmt: LogFormat = "text") -> None:
    """The root logger at ``level`` in ``fmt``; libraries that chatter stay at WARNING unless
    ``level`` is DEBUG."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(
            logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING
        )
