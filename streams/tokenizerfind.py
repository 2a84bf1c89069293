"""Where a served model's tokenizer is, without anyone configuring it.

An engine names the model it serves from (vLLM's ``/v1/models``: ``root``, the path or Hugging
Face repository given to ``vllm serve``; the agent carries it in the heartbeat's
``model_source``). A router finds the same tokenizer files where they exist on its own machine:

* a folder named like the source's last part under one of ``router.tokenizer_dirs`` (the
  models volume the engines mount, e.g. ``/models``), holding ``tokenizer.json``;
* for a repository id (``org/name``), the Hugging Face cache (``HF_HUB_CACHE``, else
  ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), as huggingface_hub itself reads it.

A path the heartbeat names is never read as it is: only folders under the configured
directories and the cache are looked at (a heartbeat must not make a router read its files).
The chat template comes from the same folder (``chat_template.jinja``, else
``tokenizer_config.json``), the special tokens from ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from streams.tokenization import TokenizerSpec, token_text

__all__ = ["find_tokenizer"]

_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def find_tokenizer(
    source: str, dirs: Sequence[str] = (), cache_dir: str | None = None
) -> TokenizerSpec | None:
    """The tokenizer of the model served from ``source``, where this machine has it; None
    when it has not."""
    name = PurePosixPath(source.rstrip("/")).name
    if _NAME.fullmatch(name) and ".." not in name:
        for d in dirs:
            folder = Path(d) / name
            if (folder / "tokenizer.json").is_file():
                return _spec(folder)
    if _REPO.fullmatch(source) and ".." not in source:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(source, "tokenizer.json", cache_dir=cache_dir)
        if isinstance(path, str):
            return _spec(Path(path).parent)
    return None


def _spec(folder: Path) -> TokenizerSpec:
    config = folder / "tokenizer_config.json"
    jinja = folder / "chat_template.jinja"
    bos = eos = ""
    if config.is_file():
        try:
            cfg = json.loads(config.read_bytes())
        except ValueError:
            cfg = {}
        bos, eos = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))
    template = jinja if jinja.is_file() else config if config.is_file() else None
    return TokenizerSpec(
        tokenizer=f"file:{folder / 'tokenizer.json'}",
        chat_template_file=f"file:{template}" if template is not None else None,
        bos_token=bos,
        eos_token=eos,
    )
