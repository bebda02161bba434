"""A multi-turn chat set built from MBPP offline: what a code assistant hears about one function.

    .venv/bin/python -m benchmarks.mbpp_chat --out chats.jsonl [--mbpp ../shared/data/mbpp.jsonl]
        [--limit N] [--no-system]

How the set is built. One conversation per MBPP row, in file order (the first --limit rows):
a system message ("You are a helpful coding assistant.", left out with --no-system), then three
user turns about the same code:
 1. the task, as the split writes it (`pipeline.split.make_prompt`: the problem and one test);
 2-3. two different follow-ups from FOLLOW_UPS, the requests a code assistant gets on code it has
    just written (types and docs, more tests, edge cases, an explanation, a rewrite), picked by
    `random.Random(task_id).sample(FOLLOW_UPS, 2)`: the same row gives the same turns in every run.
No assistant turns: the teacher writes them turn by turn (`make distill`), each with its own
earlier answers in the history. The output is a `chat` JSONL file (`data.format: chat`, or
inferred), read by `python -m pipeline split --set data.source=chats.jsonl`. MBPP itself is read
from its file, never copied into the repository.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from pipeline.split import make_prompt, parse_mbpp_lines

SYSTEM = "You are a helpful coding assistant."
FOLLOW_UPS = (
    "Add type hints and a docstring to the function.",
    "Write three more assert tests for it, including an edge case.",
    "Make it handle empty input without raising.",
    "Explain in two sentences how it works.",
    "Rewrite it without using any imports.",
    "What is its time complexity? Can it be made faster?",
    "Rename the variables so the code reads more clearly.",
    "Rewrite it as a one-liner if that stays readable, or say why not.",
)


def conversation(row: dict[str, Any], system: bool = True) -> dict[str, Any]:
    """One MBPP row as a chat line: {"messages": [system?, user, user, user]}."""
    follow_ups = random.Random(row["task_id"]).sample(FOLLOW_UPS, 2)
    turns = [make_prompt(row), *follow_ups]
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages += [{"role": "user", "content": text} for text in turns]
    return {"messages": messages}


def build(mbpp: Path, limit: int | None = None, system: bool = True) -> list[dict[str, Any]]:
    rows = parse_mbpp_lines(mbpp.read_text(encoding="utf-8").splitlines(), str(mbpp))
    return [conversation(row, system) for row in rows[:limit]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the chat JSONL file to write")
    ap.add_argument("--mbpp", type=Path, default=Path("../shared/data/mbpp.jsonl"))
    ap.add_argument("--limit", type=int, default=None, help="the first N MBPP rows only")
    ap.add_argument("--no-system", action="store_true", help="no system message")
    args = ap.parse_args(argv)
    lines = build(args.mbpp, args.limit, system=not args.no_system)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in lines))
    print(f"wrote {len(lines)} conversations ({len(lines) * 3} user turns) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
