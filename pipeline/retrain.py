"""Scheduled retraining: split, distill, train, merge, bench, then the promotion gate.

    python -m pipeline retrain --config FILE [--resume RUN_ID]     (or: make retrain)

Each run is a workspace in <artifacts>/runs/<run_id>/. A stage whose manifest (input hashes,
config sections, output hashes) still matches is skipped: a crashed run resumes where it failed
(without --resume, the latest unfinished run); one job at a time (<artifacts>/phoenix.lock).
The new draft is published and becomes <artifacts>/current only if its bench was lossless and
its held-out acceptance beats the promoted draft's (first run: the base's) by `retrain.min_gain`.

Exit codes for schedulers: 0 promoted (or nothing to do), 2 bad config or input, 3 teacher
unavailable (retry later), 4 lossless check failed, 5 gate rejected, 6 lock held.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from . import bench, drafts, merge, models, publish, specs, split, teacher, traffic, train
from .artifacts import acceptance_of, current_run, point_current
from .config import Config
from .errors import ConfigError, GateRejected, InputError
from .workspace import Workspace, atomic_write_json, content_hash, new_run_id, sha256_file

log = logging.getLogger(__name__)

STAGES = ("split", "distill", "train", "merge", "bench")
ENDED = ("promoted", "rejected")  # run.json statuses of a run that is over

# What each stage reads (files in the run workspace) and which config sections shape it.
STAGE_INPUTS: dict[str, tuple[list[str], list[str]]] = {
    "split": ([], ["data"]),
    "distill": (["data/train.jsonl"], ["teacher", "distill", "models"]),
    "train": (["teacher/answers.jsonl"], ["train", "models", "teacher"]),
    "merge": (["adapter/metrics.json", "adapter/model"], ["merge", "models", "train"]),
    "bench": (["merged", "data/test.jsonl"], ["bench", "bandit", "models"]),
}
TRAFFIC_SINCE = "traffic-since.txt"  # retrain.data=traffic: the watermark a run started from

STAGE_OUTPUTS = {
    "split": ["data/train.jsonl", "data/test.jsonl", "data/manifest.json"],
    "distill": ["teacher/answers.jsonl", "teacher/summary.json"],
    "train": ["adapter/metrics.json", "adapter/model"],
    "merge": ["merged"],
    "bench": ["bench/results.json"],
}


def path_hash(path: Path) -> str | None:
    """sha256 of a file, or of a directory's files (names and contents); None if absent."""
    if path.is_file():
        return sha256_file(path)
    return content_hash(path) if path.is_dir() else None


def stage_manifest(stage: str, cfg: Config, ws: Workspace, with_outputs: bool) -> dict[str, Any]:
    files, sections = STAGE_INPUTS[stage]
    resolved = cfg.resolved()
    inputs = {f: path_hash(ws.root / f) for f in files}
    if stage == "split" and cfg.retrain.data == "traffic":  # the watermark fixed at the start
        sections = ["retrain", "traffic"]
        inputs["traffic_since"] = ws.root.joinpath(TRAFFIC_SINCE).read_text().strip()
    elif stage == "split":
        inputs["source"] = split.load_source(cfg)[2]
    manifest: dict[str, Any] = {
        "stage": stage,
        "inputs": inputs,
        "config": {s: resolved[s] for s in sections},
    }
    if with_outputs:
        manifest["outputs"] = {f: path_hash(ws.root / f) for f in STAGE_OUTPUTS[stage]}
    return manifest


def stage_is_current(stage: str, cfg: Config, ws: Workspace) -> bool:
    path = ws.root / "manifests" / f"{stage}.json"
    if not path.exists():
        return False
    saved = json.loads(path.read_text())
    now = stage_manifest(stage, cfg, ws, with_outputs=True)
    return saved == now and all(v is not None for v in now["outputs"].values())


# --- the job ---------------------------------------------------------------------------------
def pick_run(root: Path, resume: str | None) -> tuple[str, bool]:
    runs = root / "runs"
    if resume:
        if not (runs / resume).is_dir():
            raise InputError(f"no run {resume!r} under {runs}")
        return resume, True
    for d in sorted(runs.glob("*"), reverse=True) if runs.is_dir() else []:
        info = d / "run.json"
        if info.exists() and json.loads(info.read_text()).get("status") not in ENDED:
            return d.name, True
    return new_run_id(), False


def run(cfg: Config, root: Path, telemetry, resume: str | None = None) -> dict[str, Any]:
    root = Path(root)
    run_id, resuming = pick_run(root, resume)
    if cfg.retrain.data == "traffic" and not resuming:
        ok, why = enough_traffic(cfg, root)
        if not ok:
            log.info("retrain: nothing to do: %s", why)
            return {"status": "nothing_to_do", "reason": why}
        log.info("retrain on traffic: %s", why)
    with Workspace(root).lock("retrain", run_id, cfg.lock):
        ws = Workspace(root / "runs" / run_id, cache=root / "cache")
        info_file = ws.root / "run.json"
        info = (
            json.loads(info_file.read_text())
            if info_file.exists()
            else {
                "run_id": run_id,
                "status": "running",
                "data": cfg.retrain.data,
                "stages": {},
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
        started_on = info.get("data") or ("traffic" if (ws.root / TRAFFIC_SINCE).exists() else
                                          "mbpp" if info.get("stages") else None)  # fmt: skip
        if started_on is not None and started_on != cfg.retrain.data:
            raise ConfigError(
                f"run {run_id} ({ws.root}) started on retrain.data={started_on}; resuming it with "
                f"retrain.data={cfg.retrain.data} would mix both in one run: resume it with "
                f"retrain.data={started_on}, or let it end before starting a "
                f"{cfg.retrain.data} run"
            )
        info.setdefault("data", cfg.retrain.data)
        how = "resuming" if resuming else "starting"
        log.info("retrain: %s run %s in %s", how, run_id, ws.root)
        on_traffic = cfg.retrain.data == "traffic"
        since = online_start(root, ws) if on_traffic else 0.0
        stage_cfg = run_config(cfg, root)
        steps = {
            "split": lambda: split.run(stage_cfg, ws),
            "distill": lambda: teacher.run(stage_cfg, ws),
            "train": lambda: train.run(stage_cfg, ws),
            "merge": lambda: merge.run(stage_cfg, ws, push=False),  # the gate publishes
            "bench": lambda: bench.run(stage_cfg, ws, telemetry),
        }
        if on_traffic:
            steps["split"] = lambda: traffic.split_stage(stage_cfg, ws, root, since)
            steps["distill"] = lambda: traffic_answers(stage_cfg, ws)
        for stage in STAGES:
            if stage_is_current(stage, stage_cfg, ws):
                log.info("retrain: %s is up to date: skipped", stage)
                info["stages"][stage] = "skipped"
                continue
            info["stages"][stage] = "running"
            atomic_write_json(info_file, info)
            with telemetry.stage(stage) as figures:
                figures.update(steps[stage]() or {})
            atomic_write_json(
                ws.root / "manifests" / f"{stage}.json",
                stage_manifest(stage, stage_cfg, ws, with_outputs=True),
            )
            info["stages"][stage] = "done"
            atomic_write_json(info_file, info)

        if info.get("status") in ENDED:
            log.info("retrain: run %s already ended (%s); nothing to do", run_id, info["status"])
            return info
        decision = promote_or_reject(cfg, root, ws, run_id)
        info["status"] = "promoted" if decision["promoted"] else "rejected"
        info["gate"] = decision
        info["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        atomic_write_json(info_file, info)
        if not decision["promoted"]:
            raise GateRejected(f"run {run_id} not promoted: {decision['reason']}")
        return info


def promote_or_reject(cfg: Config, root: Path, ws: Workspace, run_id: str) -> dict[str, Any]:
    results = json.loads(ws.bench_results.read_text())
    mode = cfg.retrain.gate_mode
    new = acceptance_of(results, "distilled", mode)
    current = current_run(root)
    if cfg.retrain.data == "traffic":  # "base": the promoted draft, on the same held-out traffic
        old = acceptance_of(results, "base", mode)
        against = f"promoted run {current}" if current else "the base draft"
        against += " on the held-out traffic"
    elif current is not None and current != run_id:
        old_results = json.loads(Workspace(root / "runs" / current).bench_results.read_text())
        old, against = acceptance_of(old_results, "distilled", mode), f"promoted run {current}"
    else:
        old, against = acceptance_of(results, "base", mode), "the base draft"
    decision: dict[str, Any] = {
        "mode": mode,
        "new_acceptance": new,
        "baseline_acceptance": old,
        "baseline": against,
        "min_gain": cfg.retrain.min_gain,
        "lossless": results["lossless"],
    }
    if not results["lossless"]:
        reason = "the bench was not lossless"
    elif new is None or old is None:
        reason = f"no {mode} acceptance to compare (configure bench.fixed_arms / retrain.gate_mode)"
    elif new - old < cfg.retrain.min_gain:
        reason = (
            f"acceptance {new:.4f} does not beat {against} ({old:.4f}) by {cfg.retrain.min_gain} "
            f"(gain {new - old:+.4f})"
        )
    else:
        reason = None
    decision["promoted"] = reason is None
    decision["reason"] = (
        reason or f"acceptance {new:.4f} beats {against} ({old:.4f}) by {new - old:+.4f}"
    )
    atomic_write_json(ws.root / "gate.json", decision)
    if reason is not None:
        log.warning("gate: %s; `current` stays %s", reason, current)
        return decision
    decision["published"] = publish.publish(cfg.publish, root, ws.merged, rid=run_id)
    atomic_write_json(ws.root / "gate.json", decision)  # with the version the server names
    point_current(root, run_id)
    log.info("gate: %s; promoted run %s", decision["reason"], run_id)
    return decision


def online_start(root: Path, ws: Workspace) -> float:
    """retrain.data=traffic: the promoted run's newest traffic time (0: none), fixed in the
    run's folder at its start."""
    marker = ws.root / TRAFFIC_SINCE
    if marker.is_file():
        return float(marker.read_text())
    current = current_run(root)
    since = traffic.watermark(root / "runs" / current) if current else 0.0
    ws.root.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{since!r}\n")
    return since


def run_config(cfg: Config, root: Path) -> Config:
    """The config a run's stages see: no head (a run retrains the draft model alone); a first
    MBPP run benches the base draft too; on traffic, training continues from the draft `serve`
    would serve (its real path), benched as "base" beside the new one."""
    if cfg.trains_head():
        cfg = cfg.model_copy(update={"models": cfg.models.model_copy(update={"head": None})})
    if cfg.retrain.data != "traffic":
        if current_run(root) is not None or "base" in cfg.bench.drafts:
            return cfg
        bench_cfg = cfg.bench.model_copy(update={"drafts": ["base", *cfg.bench.drafts]})
        return cfg.model_copy(update={"bench": bench_cfg})
    served = drafts.resolve_served(cfg, Workspace(root), "latest")
    update: dict[str, Any] = {
        "bench": cfg.bench.model_copy(update={"drafts": ["base", "distilled"]})
    }
    if served.source != "base":
        update["models"] = cfg.models.model_copy(update={"draft": str(Path(served.spec).resolve())})
    return cfg.model_copy(update=update)


def traffic_answers(cfg: Config, ws: Workspace) -> dict[str, Any]:
    tok = models.load_tokenizer(specs.resolve(cfg.models.target, ws.models_cache))
    return traffic.answers_stage(ws, tok)


def enough_traffic(cfg: Config, root: Path) -> tuple[bool, str]:
    """Whether a traffic run has something to learn (before a run folder is made)."""
    current = current_run(root)
    since = traffic.watermark(root / "runs" / current) if current else 0.0
    ended = [  # a rejected run is not retried on the same records
        traffic.watermark(d)
        for d in (root / "runs").glob("*")
        if (d / "run.json").is_file()
        and json.loads((d / "run.json").read_text()).get("status") in ENDED
    ]
    last = max([since, *ended])
    folder = traffic.traffic_folder(cfg, root)
    records, skipped = traffic.read_traffic(folder)
    r = cfg.retrain
    train, test = traffic.select(records, since, r.traffic_test_size)
    fresh = sum(1 for x in records if x["ts"] > last and traffic.trainable(x))
    ok = len(train) >= r.traffic_min_records and len(test) > 0 and fresh >= r.traffic_min_records
    return ok, (
        f"{len(train)} new trainable record(s) and {len(test)} to hold out under {folder} "
        f"since {'run ' + current if current else 'the start'}, {fresh} newer than the last run "
        f"that ended ({skipped} bad line(s) skipped); "
        f"retrain.traffic_min_records is {r.traffic_min_records}"
    )
