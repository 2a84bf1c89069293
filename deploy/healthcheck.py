"""A container's health check: ``python -m deploy.healthcheck [URL]``.

GETs ``URL`` (default: ``$KVGATE_HEALTH_URL``) and exits 0 on a 2xx answer within 3 s, 1
otherwise. Components without an HTTP endpoint (agent, sink) leave the variable unset: the check
then only says the interpreter and kvgate's packages load, and the orchestrator's restart on exit
covers the rest.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

__all__ = ["check"]


def check(url: str | None, timeout_s: float = 3.0) -> bool:
    if not url:
        return True
    if not url.startswith(("http://", "https://")):
        return False
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - http(s) only
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("KVGATE_HEALTH_URL")
    sys.exit(0 if check(target) else 1)
