"""A served model's tokenizer found from what its engine serves it from (the heartbeat's
``model_source``): a folder of ``router.tokenizer_dirs`` or the Hugging Face cache, read by
huggingface_hub itself; nothing outside those is ever read."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest

from router.flow.tokenizers import TokenizerDiscovery
from router.settings import RouterSettings
from streams.schemas import Heartbeat
from streams.tokenization import load_tokenization
from streams.tokenizerfind import find_tokenizer

TOKENIZER = importlib.resources.files("anthropic").joinpath("tokenizer.json").read_bytes()
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
)


def _model_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_bytes(TOKENIZER)
    config = {"chat_template": CHATML, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _hf_cache(cache: Path, repo: str, commit: str = "a" * 40) -> Path:
    """The Hugging Face cache's layout: models--org--name/{refs/main, snapshots/<commit>/}."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return _model_folder(root / "snapshots" / commit)


def test_a_model_folder_under_the_configured_dirs_is_found_by_the_sources_last_part(
    tmp_path: Path,
) -> None:
    folder = _model_folder(tmp_path / "models" / "Qwen2.5-7B-Instruct")
    spec = find_tokenizer("/mnt/engine/models/Qwen2.5-7B-Instruct", [str(tmp_path / "models")])
    assert spec is not None and spec.tokenizer == f"file:{folder / 'tokenizer.json'}"
    assert spec.chat_template_file == f"file:{folder / 'tokenizer_config.json'}"
    assert (spec.bos_token, spec.eos_token) == ("<s>", "</s>")
    assert load_tokenization(spec).exact
    assert find_tokenizer("/mnt/engine/models/Other", [str(tmp_path / "models")]) is None
    # a chat_template.jinja beside it is the template (newer models ship it so)
    (folder / "chat_template.jinja").write_text(CHATML)
    spec = find_tokenizer("Qwen2.5-7B-Instruct", [str(tmp_path / "models")])
    assert spec is not None and spec.chat_template_file == f"file:{folder / 'chat_template.jinja'}"
    assert spec.bos_token == "<s>"


def test_a_repository_id_is_found_in_the_hugging_face_cache(tmp_path: Path) -> None:
    snapshot = _hf_cache(tmp_path / "hub", "meta-llama/Llama-3.1-8B-Instruct")
    spec = find_tokenizer("meta-llama/Llama-3.1-8B-Instruct", cache_dir=str(tmp_path / "hub"))
    assert spec is not None and spec.tokenizer == f"file:{snapshot / 'tokenizer.json'}"
    assert find_tokenizer("meta-llama/Llama-3.1-70B", cache_dir=str(tmp_path / "hub")) is None


def test_nothing_outside_the_configured_dirs_and_the_cache_is_read(tmp_path: Path) -> None:
    outside = _model_folder(tmp_path / "secret")
    models = tmp_path / "models"
    models.mkdir()
    for source in (str(outside), "../secret", "/x/..", "..", "a/../../secret", ""):
        assert find_tokenizer(source, [str(models)], cache_dir=str(tmp_path)) is None, source


def _hb(model: str, source: str | None) -> Heartbeat:
    return Heartbeat(
        node_id="n1",
        epoch="e",
        seq=0,
        ts=1.0,
        endpoint="http://e",
        model=model,
        model_source=source,
        block_size=16,
        kv_blocks_total=10,
        kv_blocks_used=0,
        running=0,
        waiting=0,
    )


def test_discovery_looks_each_source_up_once_and_never_replaces_a_configured_tokenizer(
    tmp_path: Path,
) -> None:
    _model_folder(tmp_path / "tiny")
    settings = RouterSettings.model_validate(
        {
            "tokenizer_dirs": [str(tmp_path)],
            "tokenizers": {"configured": {"tokenizer": "package:anthropic/tokenizer.json"}},
        }
    )
    tokenizations = {m: load_tokenization(t) for m, t in settings.tokenizers.items()}
    d = TokenizerDiscovery(settings, tokenizations)
    beats = [_hb("tiny", "/models/tiny"), _hb("tiny", "/models/tiny"), _hb("gone", "/m/gone")]
    beats += [_hb("configured", "/models/tiny"), _hb("unsourced", None)]
    assert d.due(beats) == [("tiny", "/models/tiny"), ("gone", "/m/gone")]
    for model, source in d.due(beats):
        found = d.look_up(model, source)
        if found is not None:
            d.install(model, found)
    assert tokenizations["tiny"].exact and "gone" not in tokenizations
    assert d.due(beats) == []  # tried once each
    assert d.report() == {
        "configured": "configured",
        "gone": "not found: /m/gone",
        "tiny": "found: /models/tiny",
    }
    off = TokenizerDiscovery(RouterSettings(tokenizer_discovery=False), {})
    assert off.due(beats) == []


@pytest.mark.parametrize("source", ["x" * 501])
def test_a_heartbeat_source_is_bounded(source: str) -> None:
    with pytest.raises(ValueError):
        _hb("m", source)
