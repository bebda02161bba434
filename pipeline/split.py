"""Split MBPP into training and held-out prompts.

    python -m pipeline split --config configs/default.yaml     (or: make split)

Writes <artifacts>/data/{train,test}.jsonl and manifest.json. Rerunning gives identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

from .config import Config
from .errors import InputError
from .workspace import Workspace, atomic_write_json, atomic_write_jsonl, sha256_file

log = logging.getLogger(__name__)

REQUIRED_FIELDS = {"task_id": int, "text": str, "test_list": list}


def make_prompt(row: dict[str, Any]) -> str:
    """The user message both models see: the problem plus one test as the expected signature."""
    return f"{row['text'].strip()}\nYour code should pass this test:\n{row['test_list'][0].strip()}"


def parse_mbpp_lines(lines: list[str], origin: str) -> list[dict[str, Any]]:
    rows = []
    seen: dict[int, int] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{origin}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{origin}:{n}: expected a JSON object")
        for field, kind in REQUIRED_FIELDS.items():
            if field not in row:
                raise InputError(f"{origin}:{n}: missing field '{field}'")
            if not isinstance(row[field], kind) or isinstance(row[field], bool):
                raise InputError(f"{origin}:{n}: field '{field}' must be {kind.__name__}")
        if not row["test_list"] or not all(isinstance(t, str) for t in row["test_list"]):
            raise InputError(f"{origin}:{n}: field 'test_list' must be a non-empty list of strings")
        if not row["text"].strip():
            raise InputError(f"{origin}:{n}: field 'text' is empty")
        if row["task_id"] in seen:
            raise InputError(
                f"{origin}:{n}: duplicate task_id {row['task_id']} (first on line {seen[row['task_id']]})"
            )
        seen[row["task_id"]] = n
        rows.append(row)
    if not rows:
        raise InputError(f"{origin}: no rows")
    return rows


def split_rows(
    rows: list[dict[str, Any]], seed: int, train_size: int, test_size: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Shuffle (by task_id order first, so input order does not matter) and cut. Pure."""
    if train_size + test_size > len(rows):
        raise InputError(
            f"train_size + test_size = {train_size + test_size} exceeds the {len(rows)} rows available"
        )
    ordered = sorted(rows, key=lambda r: r["task_id"])
    random.Random(seed).shuffle(ordered)
    return ordered[:train_size], ordered[train_size : train_size + test_size]


def _to_example(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "task_id": row["task_id"],
        "prompt": make_prompt(row),
        "text": row["text"],
        "test_list": row["test_list"],
        "reference_code": row.get("code", ""),
    }


def load_source(cfg: Config) -> tuple[list[dict[str, Any]], str, str]:
    """Rows, a description of the source, and its sha256 (of the file, or of the rows)."""
    source = os.environ.get("PHOENIX_MBPP") or cfg.data.source
    path = Path(source)
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        return parse_mbpp_lines(lines, str(path)), str(path), sha256_file(path)
    looks_like_path = source.endswith((".jsonl", ".json")) or source.startswith((".", "/", "~"))
    if looks_like_path or path.exists():
        raise InputError(
            f"MBPP file not found: {source}. Point data.source (or PHOENIX_MBPP) at the MBPP "
            "JSONL file, or set it to the Hub dataset 'google-research-datasets/mbpp'."
        )
    try:
        import datasets

        ds = datasets.load_dataset(source, cfg.data.hub_config)
    except Exception as exc:  # network, unknown id, ...
        raise InputError(
            f"could not load MBPP: '{source}' is not a local file and loading it from the Hub "
            f"failed ({type(exc).__name__}: {exc}). Set PHOENIX_MBPP to the local JSONL file."
        ) from None
    lines = [json.dumps(r) for name in sorted(ds) for r in ds[name]]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return parse_mbpp_lines(lines, f"hub:{source}"), f"hub:{source}/{cfg.data.hub_config}", digest


def run(cfg: Config, ws: Workspace) -> dict[str, Any]:
    rows, origin, digest = load_source(cfg)
    train, test = split_rows(rows, cfg.data.seed, cfg.data.train_size, cfg.data.test_size)
    manifest = {
        "source": origin,
        "source_sha256": digest,
        "rows": len(rows),
        "seed": cfg.data.seed,
        "train_size": len(train),
        "test_size": len(test),
        "train_task_ids": [r["task_id"] for r in train],
        "test_task_ids": [r["task_id"] for r in test],
    }
    atomic_write_jsonl(ws.train_file, (_to_example(r) for r in train))
    atomic_write_jsonl(ws.test_file, (_to_example(r) for r in test))
    atomic_write_json(ws.data / "manifest.json", manifest)
    log.info("split %s: %d train, %d test -> %s", origin, len(train), len(test), ws.data)
    return {"train": len(train), "test": len(test), "source_sha256": digest}
