"""What later stages and the server read of earlier stages' outputs, in one leaf module.

    <artifacts>/current              a link to runs/<run id>: the promoted retrain run
    <artifacts>/registry/<name>/     the local registry: vNNNN-<run id>/ versions, latest.json
    <folder>/phoenix.json            merge wrote it after its logit check passed: "verified"
    <folder>/publish.json            where merge pushed it (merged/ only; never pushed itself)
    <bench>/results.json             the bench's rows, and the weights id of each draft it ran

Stages read and write these through the functions here; it imports only `workspace`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .workspace import Workspace, sha256_file

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
VERIFIED = "phoenix.json"  # merge's record, written only once its check passed
PUSH_RECORD = "publish.json"  # merge's record of where a draft was pushed (never pushed)


# --- the promoted run ----------------------------------------------------------------------
def current_pointer(root: str | Path) -> str | None:
    """Where <root>/current points (the link's own text), or None: what a watcher compares."""
    link = Path(root) / "current"
    return os.readlink(link) if link.is_symlink() else None


def current_run(root: str | Path) -> str | None:
    """The promoted run's id, or None before any promotion."""
    pointer = current_pointer(root)
    return pointer.rsplit("/", 1)[-1] if pointer else None


def point_current(root: str | Path, run_id: str) -> None:
    """Atomically repoint <root>/current at runs/<run_id> (a new link renamed over the old)."""
    root = Path(root)
    tmp = root / f".current.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(f"runs/{run_id}", tmp)
    os.replace(tmp, root / "current")


# --- drafts on disk ------------------------------------------------------------------------
def registry_root(registry: str | None, root: str | Path) -> Path:
    """The local registry: `publish.registry`, else <artifacts>/registry."""
    return Path(registry) if registry else Path(root) / "registry"


def is_verified(folder: str | Path) -> bool:
    """A merged draft that passed merge's check."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and (folder / VERIFIED).is_file()


def weights_id(folder: str | Path) -> str | None:
    """sha256 of a model directory's weights file (sharded: of the index's hash and every
    shard's name and hash), or None without weights."""
    folder = Path(folder)
    meta = folder / VERIFIED  # merge records the hash it verified
    if meta.is_file() and (folder / "model.safetensors").is_file():
        known = json.loads(meta.read_text()).get("weights_sha256")
        if known:
            return known
    for name in WEIGHTS:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return sha256_file(path)
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            shards = []
        h = hashlib.sha256(sha256_file(path).encode())
        for shard in shards:
            s = folder / shard
            h.update(f"\n{shard}:{sha256_file(s) if s.is_file() else 'missing'}".encode())
        return h.hexdigest()
    return None


def published_version(record: str | Path) -> str | None:
    """The registry version a record (merged/publish.json, a run's gate.json) says was pushed."""
    record = Path(record)
    if not record.is_file():
        return None
    return (json.loads(record.read_text()).get("published") or {}).get("version")


# --- bench results -------------------------------------------------------------------------
def acceptance_of(results: dict, draft: str, mode: str) -> float | None:
    """A bench row's acceptance (`draft`: base, distilled; `mode`: fixed_4, ...), or None."""
    rows = (r for r in results["rows"] if r["draft"] == draft and r["mode"] == mode)
    return next((r["acceptance_rate"] for r in rows), None)


def measured_acceptance(root: str | Path, wid: str, mode: str) -> tuple[float, Path] | None:
    """(acceptance, results file) of the newest bench under `root` (its own or a run's) that
    measured the weights `wid` at `mode`, or None."""
    root = Path(root)
    files = [Workspace(root).bench_results, *sorted(root.glob("runs/*/bench/results.json"))]
    for path in sorted((f for f in files if f.is_file()), key=lambda f: -f.stat().st_mtime):
        results = json.loads(path.read_text())
        for draft, sha in (results.get("draft_weights") or {}).items():
            if sha == wid and (acc := acceptance_of(results, draft, mode)) is not None:
                return acc, path
    return None
