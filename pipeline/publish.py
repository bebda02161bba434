"""Publish a merged model: a local registry of immutable versions, or the Hugging Face Hub."""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .artifacts import PUSH_RECORD, registry_root
from .config import PublishConfig
from .errors import ConfigError, PhoenixError
from .workspace import atomic_write_json, content_hash, make_temp_dir, new_run_id

log = logging.getLogger(__name__)


def publish(p: PublishConfig, root: Path, folder: Path, rid: str | None = None) -> dict[str, Any]:
    """Push `folder` per `publish` (`root`: the artifacts root, where the default registry
    lives); returns where it went."""
    rid = rid or new_run_id()
    files = sorted(str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file())
    if p.target == "none":
        return {"target": "none"}
    if p.dry_run:
        where = p.repo_id if p.target == "hub" else str(registry_root(p.registry, root) / p.name)
        log.info(
            "publish (dry run): would push %d files to %s %s: %s",
            len(files),
            p.target,
            where,
            files,
        )
        return {"target": p.target, "dry_run": True, "destination": where, "files": files}
    if p.target == "local":
        return push_local(registry_root(p.registry, root) / p.name, folder, rid)
    return push_hub(p, folder, rid)


def push_local(model_root: Path, folder: Path, rid: str) -> dict[str, Any]:
    """Each push is a new immutable version: copied under a temporary name, then renamed."""
    model_root.mkdir(parents=True, exist_ok=True)
    digest = content_hash(folder, exclude=[PUSH_RECORD])
    for existing in sorted(model_root.glob("v*")):
        meta = existing / "phoenix-version.json"
        if meta.exists() and json.loads(meta.read_text()).get("content_sha256") == digest:
            log.info("publish: identical content already registered as %s", existing)
            return {
                "target": "local",
                "version": existing.name,
                "path": str(existing),
                "new": False,
            }
    n = 1 + max((int(d.name[1:5]) for d in model_root.glob("v[0-9][0-9][0-9][0-9]-*")), default=0)
    version = f"v{n:04d}-{rid}"
    tmp = make_temp_dir(model_root, f".{version}.")
    try:
        # merge's record of where it pushed stays in merged/: inside every copy promoted later
        # it would say "not pushed".
        shutil.copytree(folder, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(PUSH_RECORD))
        (tmp / "phoenix-version.json").write_text(
            json.dumps({"version": version, "run_id": rid, "content_sha256": digest}, indent=2)
            + "\n"
        )
        final = model_root / version
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_json(model_root / "latest.json", {"version": version, "path": str(final)})
    log.info("publish: registered %s", final)
    return {"target": "local", "version": version, "path": str(final), "new": True}


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What a dropped or refused connection raises: OSError, and the transport errors of the
    HTTP client huggingface_hub speaks (httpx in 1.x, httpx2 in 2.x)."""
    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def push_hub(p: PublishConfig, folder: Path, rid: str) -> dict[str, Any]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if not p.repo_id:
        raise ConfigError("publish.target is hub but publish.repo_id is not set")
    token = os.environ.get(p.token_env)
    if not token:
        raise ConfigError(
            f"publish.target is hub but the environment variable {p.token_env} is not set"
        )
    # HF_ENDPOINT (another Hub deployment) read at call time, not at huggingface_hub's import.
    api = HfApi(token=token, endpoint=os.environ.get("HF_ENDPOINT") or None)
    attempt = 0
    while True:
        try:
            api.create_repo(p.repo_id, private=p.private, exist_ok=True)
            info = api.upload_folder(
                folder_path=str(folder),
                ignore_patterns=[PUSH_RECORD],
                repo_id=p.repo_id,
                commit_message=f"Phoenix draft, run {rid}",
            )
            log.info("publish: pushed to the Hub %s (%s)", p.repo_id, getattr(info, "oid", ""))
            return {
                "target": "hub",
                "repo_id": p.repo_id,
                "commit": getattr(info, "oid", None),
                "url": getattr(info, "commit_url", None),
                "run_id": rid,
            }
        except HfHubHTTPError as exc:
            status = getattr(exc.response, "status_code", None)
            if status in (401, 403):
                raise PhoenixError(
                    f"the Hub refused the token in {p.token_env} ({status})"
                ) from None
            if attempt >= p.retries or (status is not None and status < 500 and status != 429):
                raise PhoenixError(f"push to the Hub failed: {exc}") from None
        except _connection_errors() as exc:
            if attempt >= p.retries:
                raise PhoenixError(f"push to the Hub failed: {exc!r}") from None
        attempt += 1
        wait = min(30.0, p.retry_wait_s * 2.0 ** (attempt - 1))
        log.warning("publish: Hub push failed; retry %d in %.0fs", attempt, wait)
        time.sleep(wait)
