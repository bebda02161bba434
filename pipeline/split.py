"""Split the data into training and held-out rows.

    python -m pipeline split --config configs/default.yaml     (or: make split)

Writes <artifacts>/data/{train,test}.jsonl and manifest.json. Rerunning gives identical bytes.

`data.format` (or inferred, see pipeline/data.py): `mbpp` rows are shuffled by seed and cut (in
task-id order first); `prompts`, `chat`, `sharegpt` files and Hub datasets become conversation rows
(task_id, messages, prompt), duplicates dropped, split by conversation; `traffic` is what the
server captured (traffic.split_stage, as retrain does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

from . import data, traffic
from .config import Config, DataConfig
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
    for n, row in data.json_objects(lines, origin):
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


def source_of(cfg: Config) -> str:
    """data.source, or PHOENIX_MBPP where it applies: MBPP, i.e. format mbpp, or auto with
    data.source left at its default."""
    env = os.environ.get("PHOENIX_MBPP")
    default = DataConfig.model_fields["source"].default
    fmt, source = cfg.data.format, cfg.data.source
    if env and (fmt == "mbpp" or (fmt == "auto" and source == default)):
        return env
    return source


def _looks_like_path(source: str) -> bool:
    return source.endswith((".jsonl", ".json")) or source.startswith((".", "/", "~"))


def looks_like_mbpp(row: Any) -> bool:
    return isinstance(row, dict) and all(k in row for k in REQUIRED_FIELDS)


def format_of(cfg: Config) -> str:
    """The format to split by: data.format; for `auto`, mbpp when the file's first JSON object
    has MBPP's fields, the source is the MBPP one (default or PHOENIX_MBPP) but missing, or a Hub
    id with no data.columns; else "auto" (pipeline/data.py infers the shape from the keys)."""
    fmt, source = cfg.data.format, source_of(cfg)
    if fmt != "auto":
        return fmt
    path = Path(source)
    if not path.is_file():
        mbpp_source = (
            source != cfg.data.source or source == DataConfig.model_fields["source"].default
        )
        if _looks_like_path(source) and not mbpp_source:
            raise InputError(f"data file not found: {source}")
        return "mbpp" if mbpp_source or not cfg.data.columns else "auto"
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                first = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(first, dict):
                return "mbpp" if looks_like_mbpp(first) else "auto"
    return "auto"


def load_source(cfg: Config) -> tuple[list[dict[str, Any]], str, str]:
    """MBPP rows, a description of the source, and its sha256 (of the file, or of the rows)."""
    source = source_of(cfg)
    path = Path(source)
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        return parse_mbpp_lines(lines, str(path)), str(path), sha256_file(path)
    if _looks_like_path(source) or path.exists():
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


def run_mbpp(cfg: Config, ws: Workspace) -> dict[str, Any]:
    sizes = (cfg.data.train_size, cfg.data.test_size)
    if any(isinstance(n, float) for n in sizes):
        raise InputError(
            f"data.train_size / data.test_size = {sizes[0]} / {sizes[1]}: MBPP takes whole "
            "numbers of rows"
        )
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


def rows_wanted(size: int | float, rows: int) -> int:
    """A size as a number of rows: an int as it is, a fraction of `rows` rounded down (>= 1)."""
    return size if isinstance(size, int) else max(1, int(size * rows))


def split_conversations(
    rows: list[dict[str, Any]], seed: int, train_size: int | float, test_size: int | float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Order the conversations by sha256(f"{seed}:{task_id}"); the first `test_size` are the test
    side, the next `train_size` the training side. Pure.

    Why by hash and test first: a conversation's place in the order depends on its own id only,
    so adding rows never moves a conversation that was in train into test when the test size is
    fixed (new rows can only push earlier test rows out of the test side), and no conversation is
    on both sides."""
    n_train, n_test = rows_wanted(train_size, len(rows)), rows_wanted(test_size, len(rows))
    if n_train + n_test > len(rows):
        raise InputError(
            f"data.train_size + data.test_size = {n_train} + {n_test} = {n_train + n_test} "
            f"exceeds the {len(rows)} unique rows available; give fewer, or fractions "
            "(e.g. data.train_size=0.9 data.test_size=0.1)"
        )

    def key(row: dict[str, Any]) -> str:
        return hashlib.sha256(f"{seed}:{row['task_id']}".encode()).hexdigest()

    ordered = sorted(rows, key=key)
    return ordered[n_test : n_test + n_train], ordered[:n_test]


def load_conversations(cfg: Config, fmt: str) -> tuple[data.Loaded, str, str]:
    """Conversation rows, a description of the source, and its sha256."""
    d, source = cfg.data, source_of(cfg)
    shape = None if fmt == "auto" else fmt
    if Path(source).is_file():
        loaded = data.load_file(source, shape, d.skip_invalid)
        return loaded, source, sha256_file(source)
    if _looks_like_path(source):
        raise InputError(f"data file not found: {source}")
    loaded = data.load_hub(source, d.hub_split, d.columns, shape, d.skip_invalid)
    text = "\n".join(json.dumps(r["messages"], sort_keys=True) for r in loaded.rows)
    return loaded, f"hub:{source}[{d.hub_split}]", hashlib.sha256(text.encode()).hexdigest()


def run_conversations(cfg: Config, ws: Workspace, fmt: str) -> dict[str, Any]:
    loaded, origin, digest = load_conversations(cfg, fmt)
    d = cfg.data
    train, test = split_conversations(loaded.rows, d.seed, d.train_size, d.test_size)
    manifest = {
        "source": origin,
        "source_sha256": digest,
        "format": loaded.format,
        "rows": len(loaded.rows),
        "duplicates_dropped": loaded.duplicates,
        "invalid_skipped": loaded.invalid,
        "seed": d.seed,
        "train_size": len(train),
        "test_size": len(test),
        "train_size_asked": d.train_size,
        "test_size_asked": d.test_size,
        "train_task_ids": [r["task_id"] for r in train],
        "test_task_ids": [r["task_id"] for r in test],
    }
    atomic_write_jsonl(ws.train_file, train)
    atomic_write_jsonl(ws.test_file, test)
    atomic_write_json(ws.data / "manifest.json", manifest)
    log.info(
        "split %s (%s): %d train, %d test of %d unique conversations (%d duplicates dropped, "
        "%d invalid skipped) -> %s",
        origin, loaded.format, len(train), len(test), len(loaded.rows), loaded.duplicates,
        loaded.invalid, ws.data,
    )  # fmt: skip
    return {"train": len(train), "test": len(test), "source_sha256": digest}


def run(cfg: Config, ws: Workspace) -> dict[str, Any]:
    fmt = format_of(cfg)
    if fmt == "traffic":
        summary = traffic.split_stage(cfg, ws, ws.root, since=0.0)
        return {"train": summary["train"], "test": summary["test"]}
    if fmt == "mbpp":
        return run_mbpp(cfg, ws)
    return run_conversations(cfg, ws, fmt)
