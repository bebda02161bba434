"""Every path under one artifacts root, and the atomic-write helpers all stages use."""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import LockHeld

log = logging.getLogger(__name__)

LOCK_NAME = "phoenix.lock"
LOCK_HEARTBEAT_S = 30.0  # the config's `lock` section's defaults
LOCK_STALE_AFTER_S = 600.0


class Workspace:
    """Paths of one workspace; `cache` is shared by all runs under a root. `part`: a second
    trained draft (`head()`) whose adapter/ and merged/ live under <root>/<part>/."""

    def __init__(self, root: str | Path, cache: str | Path | None = None, part: str = ""):
        self.root = Path(root)
        self.cache = Path(cache) if cache is not None else self.root / "cache"
        self.part = part

    def head(self) -> Workspace:
        """The EAGLE-3 head trained beside the draft (models.head=distilled)."""
        return Workspace(self.root, self.cache, part="head")

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
        return self.root / self.part / "adapter"

    @property
    def merged(self) -> Path:
        return self.root / self.part / "merged"

    @property
    def bench(self) -> Path:
        return self.root / "bench"

    @property
    def bench_results(self) -> Path:
        return self.bench / "results.json"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def models_cache(self) -> Path:
        return self.cache / "models"

    @property
    def compile_cache(self) -> Path:
        """torch.compile's on-disk caches (Inductor, AOTAutograd, dynamic-shape profiles)."""
        return self.cache / "compile"

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_NAME

    def lock(
        self, job: str, run_id: str | None = None, timing=None
    ) -> contextlib.AbstractContextManager:
        """`workspace_lock` on this workspace; `timing`: the config's `lock` section."""
        if timing is None:
            return workspace_lock(self.lock_file, job, run_id)
        return workspace_lock(self.lock_file, job, run_id, timing.heartbeat_s, timing.stale_after_s)


# --- one job per workspace -----------------------------------------------------------------
_held: dict[Path, int] = {}  # locks this process holds, with their nesting depth
_held_guard = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def workspace_lock(
    path: Path,
    job: str,
    run_id: str | None = None,
    heartbeat_s: float = LOCK_HEARTBEAT_S,
    stale_after_s: float = LOCK_STALE_AFTER_S,
) -> Iterator[None]:
    """Hold `path` (JSON naming its holder, linked into place whole) while the block runs.
    Another process gets `LockHeld` (exit 6) at once; a dead holder on this host is cleared; a
    holder on another host silent for `stale_after_s` (heartbeat every `heartbeat_s`) is taken
    over with a WARNING. Re-entrant within a process; in a distributed launch rank 0 holds it."""
    if os.environ.get("RANK", "0").strip() not in ("", "0"):  # a non-zero rank of a launch
        yield
        return
    key = path.resolve() if path.exists() else path.absolute()
    with _held_guard:
        if key in _held:
            _held[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _held_guard:
                _held[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "job": job,
        "run_id": run_id,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "heartbeat": time.time(),
        "token": os.urandom(8).hex(),  # this holding, whatever the pid (pids repeat across pods)
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(me))
    try:
        _take_lock(path, tmp, me, stale_after_s)
    finally:
        tmp.unlink(missing_ok=True)
    with _held_guard:
        _held[path.resolve()] = 1
    stop = threading.Event()
    beat = threading.Thread(
        target=_heartbeat, args=(path, me, heartbeat_s, stop), name="phoenix-lock", daemon=True
    )
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join(5)
        with _held_guard:
            _held.pop(path.resolve(), None)
        with contextlib.suppress(OSError, ValueError):  # release only our own lock
            if json.loads(path.read_text()).get("token") == me["token"]:
                path.unlink()


def _heartbeat(path: Path, me: dict, every_s: float, stop: threading.Event) -> None:
    """Refresh the lock's heartbeat until `stop`, or until it is no longer ours (an error log)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.beat")
    while not stop.wait(every_s):
        try:
            if json.loads(path.read_text()).get("token") != me["token"]:
                log.error("lost the lock %s to another job (taken over as stale)", path)
                return
            tmp.write_text(json.dumps({**me, "heartbeat": time.time()}))
            os.replace(tmp, path)
        except (OSError, ValueError) as exc:
            log.warning("lock %s: heartbeat not written: %s", path, exc)


def _last_sign_of_life(holder: dict) -> float | None:
    """Epoch seconds of the holder's last heartbeat, else its start, else None."""
    if isinstance(holder.get("heartbeat"), int | float):
        return float(holder["heartbeat"])
    try:
        return float(calendar.timegm(time.strptime(holder["started"], "%Y-%m-%dT%H:%M:%SZ")))
    except (KeyError, TypeError, ValueError):
        return None


def _take_lock(path: Path, tmp: Path, me: dict, stale_after_s: float) -> None:
    for _ in range(3):
        try:
            os.link(tmp, path)  # atomic: fails if the lock exists
            return
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}
            same_host = holder.get("host") == me["host"]
            life = _last_sign_of_life(holder)
            silent_s = time.time() - life if life is not None else None
            stale_elsewhere = not same_host and silent_s is not None and silent_s > stale_after_s
            if (
                holder
                and not stale_elsewhere
                and (not same_host or _alive(int(holder.get("pid", -1))))
            ):
                run = f", run {holder['run_id']}" if holder.get("run_id") else ""
                raise LockHeld(
                    f"another Phoenix job holds {path}: {holder.get('job', 'retrain')} "
                    f"(pid {holder.get('pid')} on {holder.get('host')}{run}, since "
                    f"{holder.get('started')}); wait for it to finish, or use another "
                    f"--artifacts (a lock whose holder is silent for {stale_after_s:.0f} s, "
                    "lock.stale_after_s, is taken over)"
                ) from None
            if stale_elsewhere:
                log.warning(
                    "taking over the lock %s: its holder %s (pid %s on %s, run %s) last "
                    "refreshed it %.0f s ago (lock.stale_after_s %.0f)",
                    path, holder.get("job"), holder.get("pid"), holder.get("host"),
                    holder.get("run_id"), silent_s, stale_after_s,
                )  # fmt: skip
            else:
                log.warning(
                    "clearing a stale lock %s (holder %s is gone)", path, holder or "unreadable"
                )
            path.unlink(missing_ok=True)
    raise LockHeld(f"could not take the lock {path}")


def make_temp_dir(parent: str | Path, prefix: str) -> Path:
    """A temporary directory (0755) beside its final place, so a rename publishes it."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    tmp.chmod(0o755)
    return tmp


def new_run_id() -> str:
    """A UTC timestamp to the microsecond: unique per run, and sorts by start time."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1e6):06d}Z"


def content_hash(folder: Path, exclude: Iterable[str] = ()) -> str:
    """One sha256 over a directory's files (relative names and contents), but `exclude`d names."""
    h = hashlib.sha256()
    skip = set(exclude)
    for f in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name not in skip):
        h.update(f.relative_to(folder).as_posix().encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


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
