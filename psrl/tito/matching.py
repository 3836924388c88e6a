"""Matching a new turn against a TITO session's recorded turns, so that only its new suffix is tokenized.

An agent resends its whole chat history every turn. The history is hashed as a chain of normalized messages and
matched against the recorded turns (the deepest one it continues, reply included, is the parent); the template's
render is checked against the parent path's recorded render, and the prompt is the path's recorded ids (the
model's sampled ids are never re-tokenized) followed by the tokenized rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psrl.tito.errors import InvalidTurn, TemplateRenderError
from psrl.tito.schema import Mismatch, MismatchType
from psrl.tito.tree import Draft, Node, PreparedTurn, Session, ids_of
from psrl.tokenizer import TEMPLATE_CALL_ARGS, ChatTemplateError, InvalidTextError, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Codec:
    """A model's tokenizer with what the store derives from it once: its end-of-turn token texts."""

    tokenizer: Tokenizer
    eot_text_of: dict[int, str]
    eot_texts: list[str]  # longest first

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Codec:
        text_of = {i: tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.eos_token_ids}
        return cls(tokenizer, text_of, sorted({t for t in text_of.values() if t}, key=len, reverse=True))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
            )
        except ChatTemplateError as exc:
            raise TemplateRenderError(str(exc)) from exc


def match_turn(
    session: Session,
    codec: Codec,
    trajectory_id: int,
    leaf: int | None,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
    model: str | None,
    *,
    debug: bool,
) -> PreparedTurn:
    """The prompt for the next turn of `trajectory_id` (its latest recorded turn: `leaf`), matched against the
    session's recorded turns; reads `session` and changes nothing. `debug`: also report where the ids depart
    from a full tokenization of the render."""
    sid = session.id
    msgs = _check_messages(messages)
    tool_list = [dict(t) for t in tools] if tools else None
    kwargs = dict(template_kwargs or {})
    taken = TEMPLATE_CALL_ARGS.intersection(kwargs)
    if taken:
        raise InvalidTurn(f"template_kwargs cannot set {sorted(taken)}: the template call sets them")
    header: dict[str, Any] = {"tools": tool_list, "template_kwargs": kwargs}
    if model is not None:  # another model's ids mean other tokens: its turns are another history
        header["model"] = model
    own_path = session.path(leaf)
    chain, items = chain_hashes([header, *msgs], own_path)
    full = codec.render(msgs, True, tool_list, kwargs)

    report: list[Mismatch] = []
    parent = _find_parent(session, own_path, msgs, chain)
    prompt_ids: list[int] = []
    rendered = 0  # the length of the parent path's render, the start of this turn's part of `full`
    new_text = full
    if parent is not None:
        path = own_path if own_path and own_path[-1] is parent else session.path(parent.id)
        start = _rendered_prefix(path, full)
        reply = msgs[parent.num_messages]
        suffix = None if start is None else _suffix_text(codec, parent, full, start, reply)
        if start is None or suffix is None:
            report.append(
                {
                    "mismatch_type": MismatchType.TEMPLATE_NOT_PREFIX_STABLE,
                    "position": 0,
                    "detail": f"the render of the conversation up to node {parent.id} is not a prefix of "
                    "the full render; tokenized the whole prompt as a new root",
                }
            )
            logger.warning("TITO session %s: template not prefix-stable, full re-tokenization", sid)
            parent = None
        else:
            rendered, new_text = start, suffix
            prompt_ids = ids_of(path)
    reused = len(prompt_ids)
    try:
        prompt_ids += codec.tokenizer.encode(new_text)
        if debug:
            report += _compare_ids(prompt_ids, codec.tokenizer.encode(full))
    except InvalidTextError as e:
        raise InvalidTurn(f"the messages cannot be tokenized: {e}") from None

    parent_id = parent.id if parent is not None else None
    first = parent.num_messages + 1 if parent is not None else 0  # items[first:]: this turn's part
    return PreparedTurn(
        session_id=sid,
        trajectory_id=trajectory_id,
        prompt_ids=prompt_ids,
        parent_node_id=parent_id,
        reused_tokens=reused,
        branched=parent_id != leaf and (parent_id is not None or leaf is not None),
        draft=Draft(len(msgs), items[first:], chain[first:], full[rendered:]),
        mismatch_report=report,
    )


def _find_parent(session: Session, own_path: list[Node], msgs: list[dict[str, Any]], chain: list[str]) -> Node | None:
    """The deepest recorded turn whose prompt messages + its assistant reply are a prefix of `msgs`.

    `own_path` is the trajectory's latest path (root -> leaf), preferred among turns with the same prompt.
    """
    own = {n.id for n in own_path}
    for n in range(len(msgs) - 1, 0, -1):
        if msgs[n].get("role") != "assistant":
            continue
        same_prompt = session.by_prompt_hash.get(chain[n])
        if not same_prompt:
            continue
        echoed = reply_signature(msgs[n])
        candidates = [
            node
            for node in map(session.nodes.__getitem__, same_prompt)
            if node.reply_signature in (None, echoed) and not node.unexported
        ]
        if candidates:
            # Two turns may share a prompt (samples of one prompt); prefer this trajectory's own, then the newest.
            return max(candidates, key=lambda node: (node.id in own, node.id))
    return None


def _suffix_text(codec: Codec, parent: Node, full: str, start: int, reply: Mapping[str, Any]) -> str | None:
    """The text of `full` after what the model sampled in `parent`; None when the template is not prefix-stable.

    `full[:start]` is the render `parent` was prompted with (see _rendered_prefix). The reply starts there;
    ChatML renders it as `...<|im_end|>\\n` while the model stops after `<|im_end|>`: the suffix starts right
    after the end-of-turn text when the output ended with it, and at the end-of-turn text when it did not (a
    length cut), so that the template's own closing is still added. A reply whose text the template renders
    as is is skipped first, so an end-of-turn text inside it (a model explaining ChatML) is not taken for
    the end.
    """
    content = reply.get("content")
    if isinstance(content, str) and content and full.startswith(content, start):
        start += len(content)
    best, eot = -1, ""
    for text in codec.eot_texts:
        pos = full.find(text, start)
        if pos >= 0 and (best < 0 or pos < best):
            best, eot = pos, text
    if best < 0:
        return None
    out = parent.output_ids
    ended = bool(out) and codec.eot_text_of.get(out[-1]) == eot
    return full[best + len(eot) if ended else best :]


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidTurn("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        # dicts are used as they are (the template's sandbox cannot change them, and the store keeps normalized
        # copies), other mappings are copied into dicts
        if type(message) is not dict and isinstance(message, Mapping):
            message = dict(message)
        if type(message) is not dict or not isinstance(message.get("role"), str):
            raise InvalidTurn(f"message {i} must be a dict with a string `role`")
        out.append(message)
    return out


def normalize(value: Any) -> Any:
    """Drop None-valued keys: agents echo `"content": null` or leave it out, and the template reads both alike."""
    if isinstance(value, Mapping):
        return {str(k): normalize(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [normalize(v) for v in value]
    return value


def chain_step(previous: str, message: Any) -> str:
    if isinstance(message, dict) and all(isinstance(v, str) for v in message.values()):
        # The common message (role + text content): skip JSON's escaping, which dominated long histories.
        # Lengths first, so that no text can pass for another split into other keys and values.
        text = "".join(f"{len(k)}\x1f{k}{len(v)}\x1f{v}" for k, v in sorted(message.items()))
    else:
        text = "\x1d" + json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    # surrogatepass: a lone surrogate (which the tokenizer then refuses) must not crash the hash first
    return hashlib.sha256(previous.encode() + b"\x00" + text.encode("utf-8", "surrogatepass")).hexdigest()


def chain_hashes(items: list[Any], recorded: list[Node]) -> tuple[list[str], list[Any]]:
    """(chain, normalized items) of the items [header, *messages], the header being the tools and template kwargs.

    chain[i] is the hash after items[i]: chain[0] identifies the header (it changes every render) and chain[i]
    the messages before index i under it. The items are matched one by one against `recorded` (a path root ->
    leaf, followed by the leaf's assistant reply when record_turn got it): as long as they match (_same: the item
    normalizes to exactly what was recorded, so hashing it again would give the recorded hash), their recorded
    hashes and normalized forms are taken as they are. Only the items after the first difference (normally just
    this turn's new messages) are normalized and hashed.
    """
    chain: list[str] = []
    normals: list[Any] = []
    if recorded:
        for item, (stored, plain, hashed) in zip(items, _recorded_items(recorded)):
            if not _same(item, stored, plain):
                break
            normals.append(stored)
            chain.append(hashed)
    for item in items[len(normals) :]:
        normals.append(normalize(item))
        chain.append(chain_step(chain[-1] if chain else "", normals[-1]))
    return chain, normals


def reply_signature(message: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What of an assistant reply the model sampled: its text (stripped, as the router's parser reports it) and
    its tool calls' names and arguments (as canonical JSON, so an agent or an API conversion that re-serializes
    them still matches). Ids and reasoning are left out: the model did not sample ids, and templates drop
    reasoning. An echo that differs here is an edited reply, so the turn branches instead of reusing ids."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    text = content.strip() if isinstance(content, str) else ""
    calls: list[tuple[str, str]] = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            calls.append(("", json.dumps(call, sort_keys=True, default=str)))
            continue
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            canonical = json.dumps(parsed, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        except (ValueError, TypeError):
            canonical = str(arguments).strip()
        calls.append((str(function.get("name")), canonical))
    return text, tuple(calls)


def _recorded_items(path: list[Node]) -> Iterator[tuple[Any, bool, str]]:
    """(normalized item, plain, chain hash after it) along `path`, then its leaf's assistant reply if known."""
    for node in path:
        yield from zip(node.items, node.plain, node.hashes)
    leaf = path[-1]
    if leaf.assistant_hash is not None:
        yield leaf.assistant, leaf.assistant_plain, leaf.assistant_hash


def _same(item: Any, stored: Any, plain: bool) -> bool:
    """Whether `item` normalizes to exactly `stored` (a normalized item), so to the same chain hash.

    `==` runs at C speed but is not exact where numbers are involved (1 == 1.0 == True and 0.0 == -0.0, which
    JSON, the hash and the template tell apart); `plain` (see plain) says `stored` holds none, and then it is.
    Otherwise _identical decides. A False for equal items only costs a hash: the chain stays exact.
    """
    if item == stored:
        return plain or _identical(item, stored)
    normal = normalize(item)
    return normal == stored and (plain or _identical(normal, stored))


def plain(value: Any) -> bool:
    """Only dicts and lists of strings (and None in lists): `==` against it is exact for JSON-like values."""
    if type(value) is dict:
        return all(map(plain, value.values()))
    if type(value) is list:
        return all(map(plain, value))
    return type(value) is str or value is None


def _identical(a: Any, b: Any) -> bool:
    """Equal, with the same JSON types all the way down (floats by their repr, as JSON writes them).

    Anything else (another type) is not identical: the caller hashes it instead.
    """
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        return a.keys() == b.keys() and all(_identical(v, b[k]) for k, v in a.items())
    if kind is list:
        return len(a) == len(b) and all(map(_identical, a, b))
    if kind is float:
        return repr(a) == repr(b)
    return kind in (str, int, bool, type(None)) and a == b


def _rendered_prefix(path: list[Node], full: str) -> int | None:
    """The length of the render the last turn of `path` was prompted with, if `full` starts with it (else None).

    That render is the concatenation of the path's rendered tails: comparing each one in place (no copy, no
    hashing) checks that the conversation so far still renders exactly as it did. A template that renders
    earlier turns differently once messages are added (not prefix-stable) fails here.
    """
    start = 0
    for node in path:
        if not full.startswith(node.rendered_tail, start):
            return None
        start += len(node.rendered_tail)
    return start


def _compare_ids(incremental: list[int], full: list[int]) -> list[Mismatch]:
    """The debug validator: where the incremental prompt departs from a full re-tokenization of the render."""
    if incremental == full:
        return []
    position = next((i for i, (a, b) in enumerate(zip(incremental, full)) if a != b), None)
    if position is None:
        return [
            {
                "mismatch_type": MismatchType.LENGTH_MISMATCH,
                "position": min(len(incremental), len(full)),
                "detail": f"incremental prompt has {len(incremental)} tokens, full re-tokenization {len(full)}",
            }
        ]
    return [
        {
            "mismatch_type": MismatchType.TOKEN_MISMATCH,
            "position": position,
            "detail": f"incremental {incremental[position : position + 8]} != re-tokenized "
            f"{full[position : position + 8]} (lengths {len(incremental)} vs {len(full)})",
        }
    ]
