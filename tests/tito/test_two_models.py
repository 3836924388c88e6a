"""TITO with two models served by one router: each model's turns are templated and tokenized with its own
tokenizer (two reference replicas whose model folders have different vocabularies and chat templates)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _procs import start_named_replicas, start_router

from psrl.gateway.processes import stop_processes
from psrl.tito import build_training_arrays
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer
from psrl.worker.model_folder import build_tiny_model_folder

B_SYSTEM = "You are model B."


def _model_b_folder(folder: Path) -> Path:
    """The tiny model with a smaller vocabulary (other ids for the same text) and a chat template that always
    writes its own system line (another render for the same messages)."""
    build_tiny_tokenizer(folder, vocab_size=400)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{{- '<|im_start|>system\\n" + B_SYSTEM + "<|im_end|>\\n' -}}" + config["chat_template"]
    config_file.write_text(json.dumps(config))
    return build_tiny_model_folder(folder)  # config.json for this vocabulary


@dataclass
class Models:
    router_url: str
    tokenizers: dict[str, Tokenizer]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, log_dir: Path) -> Iterator[Models]:
    folders = {"model-a": model_dir, "model-b": _model_b_folder(tmp_path_factory.mktemp("model-b"))}
    procs = []
    try:
        replicas = start_named_replicas(folders, log_dir, procs)
        router = start_router(log_dir, [r.url for r in replicas])
        procs.insert(0, router.proc)
        served = {m["id"] for m in httpx.get(f"{router.url}/v1/models").json()["data"]}
        assert served == set(folders)
        yield Models(router.url, {name: Tokenizer.from_folder(folder) for name, folder in folders.items()})
    finally:
        stop_processes(procs)


def _turn(url: str, sid: str, trajectory: int, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 6, "temperature": 0},
        headers={"x-smg-tito-session-id": sid, "x-smg-tito-trajectory-id": str(trajectory)},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_each_models_turns_use_its_own_tokenizer(models: Models) -> None:
    url, toks = models.router_url, models.tokenizers
    question = [{"role": "user", "content": "Hello! How are you today?"}]
    rendered = {name: tok.apply_chat_template(question) for name, tok in toks.items()}
    assert rendered["model-b"].startswith(f"<|im_start|>system\n{B_SYSTEM}") and B_SYSTEM not in rendered["model-a"]
    assert toks["model-a"].encode(rendered["model-b"]) != toks["model-b"].encode(rendered["model-b"])

    sid = httpx.post(f"{url}/tito/sessions").json()["session_id"]
    # One trajectory per model, two turns each, in one session.
    histories: dict[str, list[dict[str, Any]]] = {}
    for trajectory, name in enumerate(toks):
        messages = list(question)
        for i in range(2):
            out = _turn(url, sid, trajectory, name, messages)
            assert out["model"] == name
            if i == 0:  # a new conversation: its whole render, tokenized (later turns reuse sampled ids)
                assert out["usage"]["prompt_tokens"] == len(toks[name].encode(rendered[name]))
            messages += [out["choices"][0]["message"], {"role": "user", "content": f"And then {i}?"}]
        histories[name] = messages

    snap = httpx.get(f"{url}/tito/sessions/{sid}").json()
    assert [t["trajectory_id"] for t in snap["trajectories"]] == [0, 1]
    for trajectory, (name, tok) in enumerate(toks.items()):
        entry = snap["trajectories"][trajectory]
        acc, records = entry["accumulated_token_ids"], entry["records"]
        assert len(records) == 2 and entry["final"]
        messages = histories[name]
        # The first prompt is this model's template, tokenized with this model's tokenizer.
        assert acc[: records[0]["prompt_token_count"]] == tok.encode(tok.apply_chat_template(messages[:1]))
        # The second reuses the first turn's ids and renders the same text as this model's template would.
        second = acc[: records[1]["prompt_token_count"]]
        assert tok.decode(second, skip_special_tokens=False) == tok.apply_chat_template(messages[:3])
        arrays = build_training_arrays(snap, trajectory_id=trajectory)
        assert arrays.num_turns == 2 and int(arrays.response_ids.max()) < tok.vocab_size
    assert httpx.delete(f"{url}/tito/sessions/{sid}").status_code == 204
