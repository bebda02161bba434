"""Every path under one artifacts root, and the atomic-write helpers all stages use."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class Workspace:
    """Paths of one workspace. `cache` (converted models) is shared by all runs under a root."""

    def __init__(self, root: str | Path, cache: str | Path | None = None):
        self.root = Path(root)
        self.cache = Path(cache) if cache is not None else self.root / "cache"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def train_file(self) -> Path:
        return self.data / "train.jsonl"

    @property
    def test_file(self) -> Path:
        return self.data / "test.jsonl"

    @property
    def teacher(self) -> Path:
        return self.root / "teacher"

    @property
    def answers_file(self) -> Path:
        return self.teacher / "answers.jsonl"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def merged(self) -> Path:
        return self.root / "merged"

    @property
    def bench(self) -> Path:
        return self.root / "bench"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def models_cache(self) -> Path:
        return self.cache / "models"


def make_temp_dir(parent: str | Path, prefix: str) -> Path:
    """A temporary directory beside its final place (same filesystem, so a rename publishes it),
    readable by others like any directory (mkdtemp alone gives 0700)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    tmp.chmod(0o755)
    return tmp


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
