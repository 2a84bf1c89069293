"""Golden KV-event batches made by the engines' own event classes (an oracle kvgate did not
write): vLLM's and SGLang's.

    python -m tests.oracles.vllm_kv_events --version 0.33.0 --version 0.11.0 --sglang 0.5.23

For each version: downloads the vLLM wheel from PyPI (``pip download --no-deps``), takes
``vllm/distributed/kv_events.py`` out of it, loads that module with stand-ins for the few vLLM
internals it imports (a logger, a config class, network helpers, the ``ExternalBlockHash`` alias —
none of them touch the event classes), builds batches with vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` / ``KVEventBatch`` and encodes them exactly as vLLM's
``ZmqEventPublisher`` does (``msgspec.msgpack.Encoder().encode(batch)`` after setting the batch's
``data_parallel_rank``). Writes ``tests/data/kv_events/vllm-<version>/<case>.msgpack`` and a
``manifest.json`` describing each case's events (hashes as hex when they are bytes). The vectors
are committed; rerun when a new vLLM release changes the format.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

import msgspec

OUT = Path(__file__).resolve().parents[1] / "data" / "kv_events"
TS = 1_764_000_000.25


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)

    def __getattr__(attr: str) -> Any:  # anything else the module imports: an inert stand-in
        return lambda *a, **k: None

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def _module_from_wheel(
    package: str, version: str, member: str, workdir: Path, stubs: dict[str, types.ModuleType]
) -> types.ModuleType:
    """``member`` of ``package``'s wheel, loaded on its own with ``stubs`` for its imports. The
    wheel is downloaded into ``workdir`` unless it is there already."""
    if not any(workdir.glob(f"{package}-{version}-*.whl")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                f"{package}=={version}",
                "-d",
                str(workdir),
            ],
            check=True,
            capture_output=True,
        )
    (wheel,) = workdir.glob(f"{package}-{version}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        source = z.read(member)
    name = f"{package}_kv_events_{version.replace('.', '_')}"
    path = workdir / f"{name}.py"
    path.write_bytes(source)
    sys.modules.update(stubs)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_kv_events(version: str, workdir: Path) -> types.ModuleType:
    import logging

    stubs = {
        "vllm": _stub("vllm"),
        "vllm.config": _stub("vllm.config"),
        "vllm.config.kv_events": _stub("vllm.config.kv_events", KVEventsConfig=object),
        "vllm.logger": _stub("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": _stub("vllm.utils"),
        "vllm.utils.network_utils": _stub("vllm.utils.network_utils"),
        "vllm.v1": _stub("vllm.v1"),
        "vllm.v1.core": _stub("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": _stub(
            "vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int
        ),
    }
    return _module_from_wheel("vllm", version, "vllm/distributed/kv_events.py", workdir, stubs)


def load_sglang_kv_events(version: str, workdir: Path) -> types.ModuleType:
    names = (
        "sglang",
        "sglang.srt",
        "sglang.srt.runtime_context",
        "sglang.srt.utils",
        "sglang.srt.utils.network",
    )
    stubs = {name: _stub(name) for name in names}
    return _module_from_wheel(
        "sglang", version, "sglang/srt/disaggregation/kv_events.py", workdir, stubs
    )


def _fields(cls: Any) -> set[str]:
    return set(cls.__struct_fields__)


def _stored(
    m: Any, hashes: list[Any], parent: Any, tokens: list[int], bs: int = 16, **extra: Any
) -> Any:
    known = {k: v for k, v in extra.items() if k in _fields(m.BlockStored)}
    base: dict[str, Any] = {"lora_id": None, "medium": "GPU"}
    if "cache_salt" in _fields(m.BlockStored):  # SGLang: optional fields default to None
        base = {"lora_id": None}
    if "lora_name" in _fields(m.BlockStored):
        base["lora_name"] = None
    if "extra_keys" in _fields(m.BlockStored) and "cache_salt" not in _fields(m.BlockStored):
        # what vLLM's block pool writes: one entry per block (to_event_extra_keys), the group
        base["extra_keys"] = [None] * len(hashes)
        base["group_idx"] = 0
    base.update(known)
    return m.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs, **base
    )


def _removed(m: Any, hashes: list[Any], **extra: Any) -> Any:
    known = {k: v for k, v in extra.items() if k in _fields(m.BlockRemoved)}
    base: dict[str, Any] = {"medium": "GPU"}
    if "group_idx" in _fields(m.BlockRemoved) and "cache_salt" not in _fields(m.BlockStored):
        base["group_idx"] = 0  # vLLM's block pool names the group of an evicted block
    return m.BlockRemoved(block_hashes=hashes, **{**base, **known})


def cases(m: Any) -> dict[str, tuple[list[Any], int]]:
    """Case name -> (events, data_parallel_rank)."""
    toks = list(range(48))
    cpu = "CPU_PINNED" if "cache_salt" in _fields(m.BlockStored) else "CPU"  # SGLang / vLLM
    h = [bytes([i]) * 32 for i in range(1, 4)]
    out: dict[str, tuple[list[Any], int]] = {
        "chain_int": (
            [
                _stored(m, [101, 102], None, toks[:32]),
                _stored(m, [103], 102, toks[32:48]),
                _removed(m, [103]),
            ],
            0,
        ),
        "cleared": ([m.AllBlocksCleared(), _stored(m, [7], None, toks[:16])], 0),
        "dp_rank_1": ([_stored(m, [201], None, toks[:16])], 1),
        "offloaded": ([_stored(m, [301], None, toks[:16], medium=cpu)], 0),
    }
    if "lora_name" in _fields(m.BlockStored):
        out["lora"] = (
            [
                _stored(
                    m,
                    [401],
                    None,
                    toks[:16],
                    lora_id=3,
                    lora_name="adapter-a",
                    extra_keys=[("adapter-a",)],
                )
            ],
            0,
        )
    # an adapter without a name (what releases before lora_name sent): not reproducible
    out["lora_id_only"] = ([_stored(m, [451], None, toks[:16], lora_id=3)], 0)
    # SGLang's default page size is one token: 32 pages chained in two events, the last evicted
    pages = list(range(1001, 1033))
    out["page_1"] = (
        [
            _stored(m, pages[:20], None, toks[:20], bs=1),
            _stored(m, pages[20:], pages[19], toks[20:32], bs=1),
            _removed(m, [pages[-1]]),
        ],
        0,
    )
    if {"lora_name", "extra_keys"} <= _fields(m.BlockStored):
        # vLLM's extra keys: the adapter name in every block, the salt in the first only
        out["lora_salt"] = (
            [
                _stored(
                    m,
                    [461, 462],
                    None,
                    toks[:32],
                    lora_id=3,
                    lora_name="adapter-a",
                    extra_keys=[("adapter-a", "salt-1"), ("adapter-a",)],
                )
            ],
            0,
        )
    if "ownership" in _fields(m.BlockStored) and "cache_salt" not in _fields(m.BlockStored):
        # vLLM's offloading connector: a bare copy (hash only) of a GPU block, which the GPU
        # then evicts; a self-describing copy of another
        out["offload_cycle"] = (
            [
                _stored(m, [701, 702], None, toks[:32]),
                m.BlockStored(
                    block_hashes=[702],
                    parent_block_hash=None,
                    token_ids=[],
                    lora_id=None,
                    block_size=0,
                    medium=cpu,
                    lora_name=None,
                    group_idx=0,
                ),
                _removed(m, [702]),
                _stored(m, [703], 702, toks[32:48], medium=cpu),
            ],
            0,
        )
    if "extra_keys" in _fields(m.BlockStored):
        out["multimodal"] = (
            [_stored(m, [471], None, toks[:16], extra_keys=[(("mm-hash-1", 0),)])],
            0,
        )
        out["prompt_embeds"] = (
            [_stored(m, [481], None, toks[:16], extra_keys=[(bytes(range(32)),)])],
            0,
        )
    if "cache_salt" not in _fields(m.BlockStored):  # vLLM's hashes may be bytes, SGLang's not
        out["chain_bytes"] = (
            [_stored(m, h[:2], None, toks[:32]), _stored(m, h[2:], h[1], toks[32:])],
            0,
        )
    if "cache_salt" in _fields(m.BlockStored):  # SGLang: the salt is a field of its own
        out["cache_salt"] = ([_stored(m, [501, 502], None, toks[:32], cache_salt="salt-1")], 0)
    if "extra_keys" in _fields(m.BlockStored):
        out["cache_salt"] = (
            [_stored(m, [501, 502], None, toks[:32], extra_keys=[("salt-1",), None])],
            0,
        )
    if "group_idx" in _fields(m.BlockStored):
        out["hybrid"] = (
            [
                _stored(
                    m, [601], None, toks[:16], group_idx=0, kv_cache_spec_kind="full_attention"
                ),
                _stored(
                    m,
                    [601],
                    None,
                    toks[:16],
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=4096,
                ),
                _removed(m, [601], group_idx=1),
            ],
            0,
        )
    return out


def _plain(v: Any) -> Any:
    """JSON for a field value: bytes as ``{"hex": ...}`` wherever they are, tuples as lists."""
    if isinstance(v, bytes):
        return {"hex": v.hex()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def _describe(ev: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": type(ev).__name__}
    for name in ev.__struct_fields__:
        d[name] = _plain(getattr(ev, name))
    return d


def write(engine: str, version: str, m: Any) -> None:
    target = OUT / f"{engine}-{version}"
    target.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.msgpack.Encoder()
    manifest: dict[str, Any] = {
        "engine": f"{engine} {version}",
        "made_by": "python -m tests.oracles.vllm_kv_events",
        "cases": {},
    }
    for name, (events, rank) in cases(m).items():
        batch = m.KVEventBatch(ts=TS, events=events)
        # what ZmqEventPublisher.publish does (SGLang calls the field attn_dp_rank)
        setattr(batch, "attn_dp_rank" if engine == "sglang" else "data_parallel_rank", rank)
        (target / f"{name}.msgpack").write_bytes(encoder.encode(batch))
        manifest["cases"][name] = {
            "ts": TS,
            "data_parallel_rank": rank,
            "events": [_describe(e) for e in events],
        }
    (target / "manifest.json").write_text(json.dumps(manifest, indent=1, default=list) + "\n")
    print(f"wrote {len(manifest['cases'])} cases to {target}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", action="append", default=[], help="a vLLM version")
    p.add_argument("--sglang", action="append", default=[], help="an SGLang version")
    p.add_argument("--wheels", type=Path, help="a directory to keep (and reuse) the wheels in")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels or Path(tmp)
        wheels.mkdir(parents=True, exist_ok=True)
        for version in args.version:
            write("vllm", version, load_kv_events(version, wheels))
        for version in args.sglang:
            write("sglang", version, load_sglang_kv_events(version, wheels))


if __name__ == "__main__":
    main()
