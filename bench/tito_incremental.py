"""TITO incremental prompt preparation vs full re-render + re-tokenization, turn by turn, up to ~32k tokens.

One synthetic agent conversation (tiny ChatML tokenizer built with `build_tiny_tokenizer` into a temp folder,
with three tool definitions) grows to --turns turns and about --target-tokens prompt tokens: each turn adds a
user message of a few hundred words, or, after an assistant tool call (every --tool-every turns), a tool result of
about the same size. Words are drawn from a seeded mix of plain English and made-up syllable words, so the BPE
word cache does not make later turns cheap. The assistant's reply to each turn is a few dozen words (or a short
text plus a `<tool_call>`); its "sampled" ids are exactly the tokenization of the reply as the template renders it,
ending with the end-of-turn token `<|im_end|>` (what a model that stops on `<|im_end|>` returns).

For every turn, in the same process and side by side (order alternating between repeats, median of --repeats):

  incremental  `TitoStore.prepare_turn(sid, 0, messages, tools=TOOLS)`: reuses the ids recorded for the
               conversation so far and tokenizes only the new suffix. The Tokenizer's LRU encode cache is cleared
               before each call, and a repeat is undone with `abandon_turn`, so every call pays its real cost.
  full         `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)` +
               `tokenizer._hf.encode(text, add_special_tokens=False).ids` (the `tokenizers` object itself, so the
               LRU cache in `Tokenizer.encode` never answers).

The two must give identical ids at every turn (checked on every repeat; mismatches are listed, and the run exits
non-zero). After the last repeat the prepared turn is recorded with `record_turn(output_ids=<reply ids>,
assistant_message=<the reply>)`; that time is reported on its own and is not part of the comparison.

Run from the repo root: python bench/tito_incremental.py [--quick] [--turns 50] [--target-tokens 32000]
Results: a table on stdout (turns 1, 10, 20, ... and the last), the speed-up at the last turn against the target
(--target-speedup, 10x), and JSON with every turn under bench/out/tito_incremental_<stamp>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import environment

from psrl.tito import TitoStore
from psrl.tokenizer import Tokenizer, build_tiny_tokenizer

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "bench" / "out"

SYSTEM = "You are a careful coding agent. Read files, search the code, and run commands to answer the user."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the repository for a pattern",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command and return its output",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    },
]

_PLAIN_TEXT = (
    "the a of to and in is it that for on with as was at by be this from or have an they which one you were her "
    "all she there would their we him been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come since against "
    "go came right used take three states himself few house use during without again place around however home "
    "small found thought went say part once general high upon school every does got united left number course war "
    "until always away something fact though water less public put thing almost hand enough far took head yet "
    "government system better set told nothing night end why called didn't eyes find going look asked later point "
    "knew city next program business give group toward young days let room president side social given present "
    "several order national possible rather second face per among form important often things looked early white "
    "case john become large big need four within felt along children saw best church ever least power development "
    "light thing seemed family interest want members mind country area others done turned although open god "
    "service problem certain kind different thus began door help means sense whole matter perhaps itself york "
    "times law human line above name example action company hands local show whether five history gave today "
    "either act feet across taken past quite anything seen having death week experience body word half really"
)
_ONSETS_TEXT = "b c d f g h j k l m n p r s t v w z br cr dr fl gr kl pl pr sk sl sp st str th tr ch sh"
_VOWELS_TEXT = "a e i o u ai ea ie oo ou"
_PLAIN, _ONSETS, _VOWELS = _PLAIN_TEXT.split(), _ONSETS_TEXT.split(), _VOWELS_TEXT.split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "rk", "st", "ng", "x"]


class Words:
    """Seeded word source: ~55 % plain English, the rest made-up words of 1-4 syllables (rarely repeated)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def word(self) -> str:
        rng = self.rng
        if rng.random() < 0.55:
            w = rng.choice(_PLAIN)
        else:
            w = "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 4))
            )
        r = rng.random()
        if r < 0.04:
            w = w.capitalize()
        elif r < 0.07:
            w = str(rng.randint(0, 99999))
        return w

    def sentence(self) -> str:
        words = [self.word() for _ in range(self.rng.randint(6, 18))]
        words[0] = words[0].capitalize()
        return " ".join(words) + self.rng.choice(".....?!;:")

    def text(self, tok: Tokenizer, tokens: int) -> str:
        """Sentences (in paragraphs) until the text tokenizes to at least `tokens` ids."""
        parts: list[str] = []
        while True:
            parts.append(self.sentence())
            if self.rng.random() < 0.1:
                parts.append("\n\n")
            text = " ".join(parts).replace(" \n\n ", "\n\n").strip()
            if len(tok._hf.encode(text, add_special_tokens=False).ids) >= tokens:
                return text

    def path(self) -> str:
        return "/testbed/" + "/".join(self.word().lower() for _ in range(self.rng.randint(1, 3))) + ".py"

    def code(self, tok: Tokenizer, tokens: int) -> str:
        """File-like tool output: numbered lines of made-up Python, until `tokens` ids."""
        lines: list[str] = []
        while True:
            for _ in range(2):
                a, b, c = (self.word().lower().replace("'", "") for _ in range(3))
                lines.append(
                    self.rng.choice(
                        [
                            f"def {a}_{b}({c}, n={self.rng.randint(0, 999)}):",
                            f"    {a} = {b}.{c}({self.rng.randint(0, 99)})",
                            f"    return {a} + {b}",
                            f"# {self.sentence()}",
                            f'    raise ValueError("{self.sentence()}")',
                            f"class {a.capitalize()}{b.capitalize()}:",
                        ]
                    )
                )
            text = "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(lines))
            if len(tok._hf.encode(text, add_special_tokens=False).ids) >= tokens:
                return text


def tool_call(words: Words, turn: int) -> dict[str, Any]:
    kind = ("read_file", "search", "run")[turn % 3]
    if kind == "read_file":
        arguments: dict[str, Any] = {"path": words.path()}
    elif kind == "search":
        arguments = {"pattern": f"{words.word()}_{words.word()}", "max_results": words.rng.randint(5, 50)}
    else:
        arguments = {"command": f"python -m pytest -x -q {words.path()} -k {words.word()}"}
    return {
        "id": f"call_{turn}",
        "type": "function",
        "function": {"name": kind, "arguments": json.dumps(arguments)},
    }


def reply_ids(tok: Tokenizer, prompt_text: str, messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[int]:
    """What the model sampled for `reply`: the template's rendering of it, ending with <|im_end|>, tokenized."""
    through = tok.apply_chat_template([*messages, reply], add_generation_prompt=False, tools=TOOLS)
    if not through.startswith(prompt_text) or not through.endswith("<|im_end|>\n"):
        raise RuntimeError("the chat template does not render the reply as a suffix ending with <|im_end|>\\n")
    ids = tok._hf.encode(through[len(prompt_text) : -1], add_special_tokens=False).ids
    if ids[-1] != tok.token_to_id("<|im_end|>"):
        raise RuntimeError("the reply's ids do not end with <|im_end|>")
    return ids


def full_path(tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Render the whole conversation and tokenize all of it, past the Tokenizer's LRU encode cache."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
    return tok._hf.encode(text, add_special_tokens=False).ids


def incremental_breakdown(
    tok: Tokenizer, messages: list[dict[str, Any]], new_ids: list[int], repeats: int
) -> dict[str, float]:
    """Medians of the two main steps prepare_turn takes, timed one by one (approximate: the store's own calls)."""
    steps: dict[str, list[float]] = {"renders": [], "suffix_encode": []}
    suffix = tok.decode(new_ids, skip_special_tokens=False)
    for _ in range(repeats):
        # prepare_turn renders the whole conversation once per turn
        steps["renders"].append(timed(tok.apply_chat_template, messages, add_generation_prompt=True, tools=TOOLS)[0])
        steps["suffix_encode"].append(timed(tok._hf.encode, suffix, add_special_tokens=False)[0])
    return {k: statistics.median(v) for k, v in steps.items()}


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """(ms, result) of one call, with the garbage collector run before and kept off during it."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        return (time.perf_counter() - t0) * 1e3, out
    finally:
        gc.enable()


def first_difference(a: list[int], b: list[int]) -> str:
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (
        f"first difference at {pos}: incremental {a[pos : pos + 6]} vs full {b[pos : pos + 6]} ({len(a)} vs {len(b)})"
    )


def run(args: argparse.Namespace, tok: Tokenizer) -> tuple[list[dict[str, Any]], list[str]]:
    words = Words(args.seed)
    store = TitoStore(tok)
    sid = store.create_session()
    # Warm up the template (compiled on first use) and the code paths, outside the measurement.
    warm = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    tok.apply_chat_template(warm, add_generation_prompt=True, tools=TOOLS)
    store.prepare_turn(sid, 0, warm, tools=TOOLS)
    store.abandon_turn(sid, 0)

    current = len(tok._hf.encode(tok.apply_chat_template(warm[:1], tools=TOOLS), add_special_tokens=False).ids)

    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    pending_call: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    for turn in range(1, args.turns + 1):
        # Spread what is left of --target-tokens over the turns left (~72 % new message, ~28 % reply).
        per_turn = max(40, (args.target_tokens - current) // (args.turns - turn + 1) - 12)
        new_msg_tokens, reply_tokens = int(per_turn * 0.72), int(per_turn * 0.28)
        # The new message(s) of this turn: a tool result after a tool call, a user message otherwise.
        if pending_call is not None:
            content = words.code(tok, new_msg_tokens)
            messages.append({"role": "tool", "tool_call_id": pending_call["id"], "content": content})
            kind = "tool"
        else:
            messages.append({"role": "user", "content": words.text(tok, new_msg_tokens)})
            kind = "user"
        calls_tool = turn % args.tool_every == 0 and turn < args.turns
        if calls_tool:
            pending_call = tool_call(words, turn)
            reply = {"role": "assistant", "content": words.sentence(), "tool_calls": [pending_call]}
        else:
            pending_call = None
            reply = {"role": "assistant", "content": words.text(tok, reply_tokens)}

        incr_ms: list[float] = []
        full_ms: list[float] = []
        render_ms: list[float] = []
        prepared = None
        full_ids: list[int] = []
        text = ""
        for rep in range(args.repeats):
            for which in ("full", "incr") if rep % 2 == 0 else ("incr", "full"):
                if which == "full":
                    t_render, text = timed(tok.apply_chat_template, messages, add_generation_prompt=True, tools=TOOLS)
                    t_full, full_ids = timed(full_path, tok, messages)
                    full_ms.append(t_full)
                    render_ms.append(t_render)
                else:
                    if prepared is not None:
                        store.abandon_turn(sid, 0)
                    tok._encode_cached.cache_clear()
                    t_incr, prepared = timed(store.prepare_turn, sid, 0, messages, tools=TOOLS)
                    incr_ms.append(t_incr)
            assert prepared is not None
            if prepared.prompt_ids != full_ids:
                mismatches.append(f"turn {turn} repeat {rep + 1}: {first_difference(prepared.prompt_ids, full_ids)}")
        assert prepared is not None

        breakdown = incremental_breakdown(tok, messages, prepared.prompt_ids[prepared.reused_tokens :], args.repeats)
        out_ids = reply_ids(tok, text, messages, reply)
        t_record, _ = timed(
            store.record_turn,
            sid,
            0,
            prepared,
            output_ids=out_ids,
            output_logprobs=[0.0] * len(out_ids),
            finish_reason="stop",
            assistant_message=reply,
        )
        messages.append(reply)
        current = len(full_ids) + len(out_ids)
        incr, full = statistics.median(incr_ms), statistics.median(full_ms)
        rows.append(
            {
                "turn": turn,
                "new_message": kind,
                "tool_call_reply": calls_tool,
                "messages": len(messages) - 1,
                "prompt_tokens": len(full_ids),
                "reused_tokens": prepared.reused_tokens,
                "new_tokens": prepared.new_tokens,
                "reply_tokens": len(out_ids),
                "parent_node_id": prepared.parent_node_id,
                "incremental_ms": incr,
                "full_ms": full,
                "full_render_ms": statistics.median(render_ms),
                "speedup": full / incr if incr > 0 else float("inf"),
                "record_ms": t_record,
                "incremental_breakdown_ms": breakdown,
                "incremental_ms_all": incr_ms,
                "full_ms_all": full_ms,
                "identical": prepared.prompt_ids == full_ids,
            }
        )
        if args.verbose:
            r = rows[-1]
            print(
                f"turn {turn:3d}: {r['prompt_tokens']:6d} tok, incr {incr:7.3f} ms, full {full:7.3f} ms, "
                f"x{r['speedup']:.1f}",
                flush=True,
            )
    return rows, mismatches


def print_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    shown = sorted({1, *range(10, args.turns + 1, 10), args.turns})
    print()
    print(
        f"{'turn':>4} {'msgs':>4} {'prompt tok':>10} {'new tok':>7} {'incr ms':>8} {'full ms':>8} "
        f"{'(render)':>8} {'speed-up':>8} {'record ms':>9}"
    )
    for r in rows:
        if r["turn"] in shown:
            print(
                f"{r['turn']:>4} {r['messages']:>4} {r['prompt_tokens']:>10} {r['new_tokens']:>7} "
                f"{r['incremental_ms']:>8.3f} {r['full_ms']:>8.3f} {r['full_render_ms']:>8.3f} "
                f"{r['speedup']:>7.1f}x {r['record_ms']:>9.3f}"
            )
    print(f"(render) = the template render alone, part of 'full ms'. Medians of {args.repeats} repeats.")
    print("\nincremental, step by step (ms; timed outside the store, so approximate):")
    print(f"{'turn':>4} {'render':>9} {'suffix encode':>13} {'rest':>7} {'measured':>8}")
    for r in rows:
        if r["turn"] in shown:
            b = r["incremental_breakdown_ms"]
            print(
                f"{r['turn']:>4} {b['renders']:>9.3f} {b['suffix_encode']:>13.3f} "
                f"{r['incremental_ms'] - sum(b.values()):>7.3f} {r['incremental_ms']:>8.3f}"
            )
    print("rest = measured - render - suffix encode: matching the history to the recorded path, hashing the new")
    print("messages, checking the recorded render against the new one, and assembling the prompt ids.")


def write_json(
    rows: list[dict[str, Any]], mismatches: list[str], summary: dict[str, Any], args: argparse.Namespace
) -> Path:
    path = args.out_dir / f"tito_incremental_{args.stamp}.json"
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "environment": {**environment(), "loadavg_at_end": os.getloadavg()},
        "summary": summary,
        "mismatches": mismatches,
        "turns": rows,
    }
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=50, help="turns of the conversation")
    p.add_argument("--target-tokens", type=int, default=32000, help="about this many prompt tokens at the last turn")
    p.add_argument("--tool-every", type=int, default=4, help="every Nth assistant reply is a tool call")
    p.add_argument("--repeats", type=int, default=5, help="measurements per turn and path (median)")
    p.add_argument("--target-speedup", type=float, default=10.0, help="the speed-up the last turn should reach")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="a line per turn")
    p.add_argument("--quick", action="store_true", help="20 turns to ~12k tokens, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.target_tokens, args.repeats = min(args.turns, 20), min(args.target_tokens, 12800), 3
    if args.turns < 1 or args.repeats < 1 or args.tool_every < 2:
        p.error("--turns and --repeats must be >= 1, --tool-every >= 2")
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out_dir = OUT_DIR
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tito-bench-tok-") as tmp:
        tok = Tokenizer.from_folder(build_tiny_tokenizer(tmp))
    print(
        f"TITO incremental vs full: {args.turns} turns to ~{args.target_tokens} tokens, tool call every "
        f"{args.tool_every} turns, {args.repeats} repeats, tiny tokenizer (vocab {tok.vocab_size})",
        flush=True,
    )
    rows, mismatches = run(args, tok)
    print_report(rows, args)
    last = rows[-1]
    ok = last["speedup"] >= args.target_speedup
    summary = {
        "last_turn": last["turn"],
        "last_prompt_tokens": last["prompt_tokens"],
        "last_speedup": last["speedup"],
        "target_speedup": args.target_speedup,
        "meets_target": ok,
        "turns_with_mismatch": sorted({int(m.split()[1]) for m in mismatches}),
    }
    print(
        f"\nspeed-up at turn {last['turn']} ({last['prompt_tokens']} tokens): {last['speedup']:.1f}x "
        f"(target >= {args.target_speedup:g}x: {'met' if ok else 'NOT met'})"
    )
    if mismatches:
        print(f"ID MISMATCHES ({len(mismatches)}):")
        for m in mismatches[:20]:
            print("  " + m)
    else:
        print(f"ids identical at every turn and repeat ({args.turns} x {args.repeats})")
    path = write_json(rows, mismatches, summary, args)
    print(f"JSON: {path.relative_to(REPO)}")
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
