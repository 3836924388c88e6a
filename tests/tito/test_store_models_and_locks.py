"""TitoStore per model and per session: each turn is tokenized with its model's tokenizer (and never continues
another model's turns), and one session's long template render holds up no other session."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from psrl.tito import TitoError, TitoStore, build_all_training_arrays
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

T = TypeVar("T")
HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Tokenizer]:
    """Two models' tokenizers: the tiny one, and one trained to a smaller vocab (other ids for the same text)."""
    a = Tokenizer.from_folder(build_tiny_tokenizer(tmp_path_factory.mktemp("tok-a")))
    b = Tokenizer.from_folder(build_tiny_tokenizer(tmp_path_factory.mktemp("tok-b"), vocab_size=400))
    return a, b


def _record(store: TitoStore, prepared: Any, out: list[int]) -> int:
    return store.record_turn(
        prepared.session_id,
        prepared.trajectory_id,
        prepared,
        output_ids=out,
        output_logprobs=[-0.5] * len(out),
        finish_reason="stop",
        assistant_message={"role": "assistant", "content": "I am fine."},
    )


def test_each_turn_is_tokenized_with_its_models_tokenizer(tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    tok_a, tok_b = tokenizers
    text = tok_a.apply_chat_template(HELLO)
    assert tok_a.encode(text) != tok_b.encode(text)  # the test can tell the two apart
    store = TitoStore()  # no default tokenizer: every turn names its own
    sid = store.create_session()
    with pytest.raises(TitoError, match="no default tokenizer"):
        store.prepare_turn(sid, 0, HELLO)

    first = store.prepare_turn(sid, 0, HELLO, tokenizer=tok_a, model="a")
    assert first.prompt_ids == tok_a.encode(text)
    out_a = tok_a.encode("I am fine.<|im_end|>")
    _record(store, first, out_a)
    follow_up = [*HELLO, {"role": "assistant", "content": "I am fine."}, {"role": "user", "content": "And?"}]
    on_b = store.prepare_turn(sid, 1, follow_up, tokenizer=tok_b, model="b")
    # Model a's ids mean nothing to model b: its turn is a new root in b's own ids, not a's node continued.
    assert on_b.parent_node_id is None and on_b.reused_tokens == 0
    assert on_b.prompt_ids == tok_b.encode(tok_b.apply_chat_template(follow_up))
    _record(store, on_b, tok_b.encode("Fine.<|im_end|>"))
    on_a = store.prepare_turn(sid, 2, follow_up, tokenizer=tok_a, model="a")
    assert on_a.parent_node_id == 0 and on_a.prompt_ids[: on_a.reused_tokens] == first.prompt_ids + out_a
    store.abandon_turn(sid, 2, on_a)
    assert [a.trajectory_id for a in build_all_training_arrays(store.snapshot(sid))] == [0, 1]


def _in_thread(fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """fn() in a thread; fails (instead of hanging the test) if it does not return in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert not worker.is_alive(), "the call waited for another session's render"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_long_render_in_one_session_holds_up_no_other(tokenizers: tuple[Tokenizer, Tokenizer]) -> None:
    tok, _ = tokenizers
    slow = Tokenizer.from_folder(tok.source)  # the same model's tokenizer, whose render we hold
    rendering, release = threading.Event(), threading.Event()
    render = slow.apply_chat_template

    def held_render(messages: Any, **kw: Any) -> str:
        rendering.set()
        assert release.wait(60)
        return render(messages, **kw)

    slow.apply_chat_template = held_render  # type: ignore[method-assign]
    store = TitoStore(tok)
    busy, other = store.create_session(), store.create_session()
    held = threading.Thread(target=lambda: store.prepare_turn(busy, 0, HELLO, tokenizer=slow, model="m"))
    held.start()
    try:
        assert rendering.wait(30)
        # The render holds only its own session: the store and every other session carry on meanwhile.
        third = _in_thread(store.create_session)
        for sid in (other, third):
            prepared = _in_thread(lambda sid=sid: store.prepare_turn(sid, 0, HELLO, tokenizer=tok, model="m"))
            _in_thread(lambda prepared=prepared: _record(store, prepared, tok.encode("I am fine.<|im_end|>")))
            [traj] = _in_thread(lambda sid=sid: store.snapshot(sid))["trajectories"]
            assert len(traj["records"]) == 1
        _in_thread(lambda: store.delete_session(third))
        assert len(store) == 2 and busy in store
        # The busy session itself waits for its render: its snapshot answers once the render is done.
        box: dict[str, Any] = {}
        snap = threading.Thread(target=lambda: box.update(snap=store.snapshot(busy)))
        snap.start()
    finally:
        release.set()
        held.join(30)
    snap.join(30)
    assert not held.is_alive() and not snap.is_alive()
    [traj] = box["snap"]["trajectories"]  # the prepared, not yet recorded turn: an empty final history
    assert traj["records"] == [] and traj["final"]
