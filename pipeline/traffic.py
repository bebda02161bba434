"""Served traffic as training data: the server captures it, `retrain` learns from it.

Capture (`traffic.capture`): each finished request not opted out (`"phoenix": {"capture":
false}`) is one JSON line under <artifacts>/traffic/ (token ids, outcome, arm, acceptance,
timings; never headers, keys or addresses), in rotating files, a new one per server process.
A record trains when it finished by itself (`stop`) or at max_tokens (`length`), not when a
client's stop string cut it (`trainable`). Details: docs/pipeline.md, "Online distillation".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .config import Config
from .errors import InputError
from .workspace import Workspace, atomic_write_json, atomic_write_jsonl

log = logging.getLogger(__name__)

PREFIX = "traffic-"
REQUIRED = {"id": str, "ts": (int, float), "prompt_token_ids": list, "token_ids": list}


def prompt_hash(prompt_ids: list[int]) -> str:
    """sha256 of the rendered prompt's token ids: what dedupes traffic."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()


def trainable(record: dict) -> bool:
    """Ended by itself or at max_tokens (not by a client's stop string), with output tokens."""
    return (
        record.get("finish_reason") in ("stop", "length")
        and not record.get("stopped_by_string")
        and bool(record["token_ids"])
    )


class TrafficLog:
    """Size-bounded rotating JSONL of served requests; thread-safe. `append` never raises."""

    def __init__(self, folder: Path, max_file_bytes: int, max_files: int, pause_s: float = 60.0):
        self.folder = Path(folder)
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.pause_s = pause_s
        self.dropped = 0  # records lost while paused (disk full)
        self.paused_until = 0.0
        self._lock = threading.Lock()
        self._file = None
        self._closed = False  # after close(): a late request's record is dropped, not reopened
        self._seq = max((_seq_of(p) for p in self.folder.glob(f"{PREFIX}*.jsonl")), default=0)

    @property
    def paused(self) -> bool:
        return time.monotonic() < self.paused_until

    def append(self, record: dict) -> bool:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self.paused or self._closed:
                self.dropped += 1
                return False
            try:
                if self._file is None or self._file.tell() >= self.max_file_bytes:
                    self._rotate()
                self._file.write(line)
                self._file.flush()
            except OSError as exc:
                self.dropped += 1
                self.paused_until = time.monotonic() + self.pause_s
                self._close()
                log.warning(
                    "traffic capture paused for %.0f s: writing under %s failed (%s); serving "
                    "continues, %d record(s) dropped so far",
                    self.pause_s, self.folder, exc.strerror or exc, self.dropped,
                )  # fmt: skip
                return False
            return True

    def _rotate(self) -> None:
        self._close()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        path = self.folder / f"{PREFIX}{self._seq:06d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # users' prompts
        self._file = open(fd, "a", encoding="utf-8")  # noqa: SIM115 - held open across calls
        files = sorted(self.folder.glob(f"{PREFIX}*.jsonl"), key=_seq_of)
        for old in files[: max(0, len(files) - self.max_files)]:
            old.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._close()


def _seq_of(path: Path) -> int:
    try:
        return int(path.stem[len(PREFIX) :])
    except ValueError:
        return 0


def open_log(cfg: Config, ws: Workspace) -> TrafficLog | None:
    t = cfg.traffic
    if not t.capture:
        return None
    folder = Path(t.folder) if t.folder else ws.root / "traffic"
    log.info(
        "traffic capture on: %s (files of %s MB, at most %d)", folder, t.max_file_mb, t.max_files
    )
    return TrafficLog(folder, int(t.max_file_mb * 2**20), t.max_files, t.pause_s)


# What a captured line keeps of the request's record (`CoreResult.record()`).
CAPTURED = (
    "finish_reason", "stopped_by_string", "mode", "arm", "draft", "proposed_per_position",
    "accepted_per_position",
)  # fmt: skip


def record_of(res, prompt_ids: list[int], kind: str) -> dict[str, Any]:
    """One captured request (`res`: a serving.CoreResult)."""
    rec = res.record()
    return {
        "id": uuid.uuid4().hex,
        "ts": time.time(),
        "kind": kind,
        "prompt_sha256": prompt_hash(prompt_ids),
        "prompt_token_ids": list(prompt_ids),
        "token_ids": list(res.result.token_ids),
        **{k: rec[k] for k in CAPTURED},
        "latency_s": round(rec["latency_s"], 4),
        "tokens_per_second": round(rec["tokens_per_second"], 3),
    }


# --- reading it back --------------------------------------------------------------------------
def read_traffic(folder: Path) -> tuple[list[dict], int]:
    """(every well-formed record under `folder`, oldest first; lines skipped)."""
    records, skipped = [], 0
    for path in sorted(Path(folder).glob(f"{PREFIX}*.jsonl"), key=_seq_of):
        with open(path, "rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                    ok = isinstance(rec, dict) and all(
                        isinstance(rec.get(k), t) for k, t in REQUIRED.items()
                    )
                    ok = ok and all(isinstance(i, int) for i in rec["prompt_token_ids"])
                    ok = ok and all(isinstance(i, int) for i in rec["token_ids"])
                except (json.JSONDecodeError, UnicodeDecodeError):
                    ok = False
                if ok:
                    records.append(rec)
                else:
                    skipped += 1
    records.sort(key=lambda r: r["ts"])
    return records, skipped


def traffic_folder(cfg: Config, root: Path) -> Path:
    return Path(cfg.traffic.folder) if cfg.traffic.folder else Path(root) / "traffic"


def select(records: list[dict], since: float, test_size: int) -> tuple[list[dict], list[dict]]:
    """New trainable records (ts > since), one per prompt (its latest), split into train and
    the most recent `test_size`; no prompt in both."""
    latest: dict[str, dict] = {}
    for r in records:
        if r["ts"] > since and trainable(r):
            latest[r.get("prompt_sha256") or prompt_hash(r["prompt_token_ids"])] = r
    unique = sorted(latest.values(), key=lambda r: r["ts"])
    cut = max(0, len(unique) - test_size)
    return unique[:cut], unique[cut:]


def split_stage(cfg: Config, ws: Workspace, root: Path, since: float) -> dict[str, Any]:
    """retrain's split on traffic: data/train.jsonl and test.jsonl from records after `since`."""
    folder = traffic_folder(cfg, root)
    records, skipped = read_traffic(folder)
    if skipped:
        log.warning("traffic: skipped %d malformed line(s) under %s", skipped, folder)
    r = cfg.retrain
    train, test = select(records, since, r.traffic_test_size)
    if len(train) < r.traffic_min_records or not test:
        raise InputError(
            f"retrain.data=traffic: {len(train)} new trainable record(s) under {folder} since the "
            f"promoted run (need retrain.traffic_min_records={r.traffic_min_records} plus "
            f"{r.traffic_test_size} held out)"
        )

    def row(n: int, rec: dict, with_answer: bool) -> dict:
        out = {
            "task_id": n,  # the stages key rows by an integer task id
            "traffic_id": rec["id"],
            "prompt_token_ids": rec["prompt_token_ids"],
            "ts": rec["ts"],
        }
        if with_answer:
            out.update(completion_token_ids=rec["token_ids"], finish_reason=rec["finish_reason"])
        return out

    ws.data.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(ws.train_file, [row(n, x, True) for n, x in enumerate(train)])
    atomic_write_jsonl(ws.test_file, [row(len(train) + n, x, False) for n, x in enumerate(test)])
    summary = {
        "source": "traffic",
        "folder": str(folder),
        "since": since,
        "until": max(x["ts"] for x in train + test),
        "records": len(records),
        "skipped_lines": skipped,
        "train": len(train),
        "test": len(test),
    }
    atomic_write_json(ws.data / "manifest.json", summary)
    log.info("traffic: %d train and %d held-out records (of %d captured, %d bad lines skipped)",
             len(train), len(test), len(records), skipped)  # fmt: skip
    return summary


def answers_stage(ws: Workspace, tokenizer) -> dict[str, Any]:
    """retrain's distill on traffic: the captured outputs are the answers (no teacher call)."""
    rows = []
    for x in (json.loads(line) for line in ws.train_file.read_text().splitlines() if line):
        ids = x["completion_token_ids"]
        rows.append(
            {
                "task_id": x["task_id"],
                "prompt_token_ids": x["prompt_token_ids"],
                "prompt": None,
                "completion": tokenizer.decode(ids, skip_special_tokens=True),
                "completion_token_ids": ids,
                "finish_reason": x["finish_reason"],
                "completion_tokens": len(ids),
            }
        )
    ws.teacher.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(ws.answers_file, rows)
    summary = {
        "source": "traffic",
        "answers": len(rows),
        "tokens": sum(len(r["completion_token_ids"]) for r in rows),
    }
    atomic_write_json(ws.teacher / "summary.json", summary)
    return summary


def watermark(run_dir: Path) -> float:
    """The newest traffic a run used (0: none, or an MBPP run)."""
    manifest = Path(run_dir) / "data" / "manifest.json"
    if not manifest.is_file():
        return 0.0
    return float(json.loads(manifest.read_text()).get("until") or 0.0)
