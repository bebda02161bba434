"""Which draft the server serves (`server.draft`): the one place that decides it.

    latest   the promoted draft (<artifacts>/current, a retrain run), else the newest verified
             merged draft (<artifacts>/merged, or the local registry's latest version), else the
             base draft (models.draft) with a warning saying how to build a distilled one
    base     models.draft, the training stage's starting point
    other    a registry version (`v0003` or `v0003-<run id>`), a model directory, or a Hub id

A draft that is missing or cannot be loaded is a ConfigError (exit 2) naming it, before the
server starts. `models.head: distilled`: the server serves whichever of the draft and the head
beside it the bench measured faster on these exact weights, or both when no bench did
(`ServedDraft.why` says which); any other `models.head` is served beside the draft.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .artifacts import (
    PUSH_RECORD,
    WEIGHTS,
    current_run,
    is_verified,
    measured_acceptance,
    published_version,
    registry_root,
    weights_id,
)
from .config import Config
from .errors import ConfigError
from .models import head_ref, is_eagle3
from .workspace import Workspace

log = logging.getLogger(__name__)

VERSION = re.compile(r"^v\d{4}(-[\w.-]+)?$")


@dataclass(frozen=True)
class ServedDraft:
    """The draft a server serves and where it came from."""

    spec: str  # what the loader gets: a directory, a Hub id, or the models.draft spec
    source: str  # promoted | merged | registry | base | explicit
    version: str | None = None  # registry version (or retrain run id) when it has one
    acceptance: float | None = None  # held-out acceptance from a bench of this exact draft
    acceptance_mode: str | None = None
    acceptance_from: str | None = None  # the results.json it comes from
    head: str | None = None  # an EAGLE-3 head served beside it (models.head), as a directory
    why: str | None = None  # models.head=distilled: why this one of the draft and the head

    @property
    def label(self) -> str:
        """Short name for tags and metrics: the version, else the spec."""
        return self.version or self.spec

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def sentence(self) -> str:
        how = {
            "promoted": "latest: the promoted draft (<artifacts>/current)",
            "merged": "latest: the newest verified merged draft",
            "registry": "latest: the newest verified draft in the local registry",
            "base": "the base draft, untrained",
            "explicit": "server.draft",
        }[self.source]
        parts = [how]
        if self.version:
            parts.append(f"version {self.version}")
        if self.acceptance is not None:
            parts.append(
                f"held-out acceptance {self.acceptance:.3f} at {self.acceptance_mode} "
                f"({self.acceptance_from})"
            )
        elif self.source != "base":
            parts.append("no bench result for this exact draft yet")
        if self.head:
            parts.append(f"EAGLE-3 head {self.head} beside it")
        text = f"{self.spec} ({'; '.join(parts)})"
        return f"{text}; {self.why}" if self.why else text


def _registry_model(cfg: Config, ws: Workspace) -> Path:
    return registry_root(cfg.publish.registry, ws.root) / cfg.publish.name


def _promoted(ws: Workspace) -> ServedDraft | None:
    run = current_run(ws.root)
    if run is None:
        return None
    run_dir = ws.root / "runs" / run
    merged = run_dir / "merged"
    if not is_verified(merged):
        raise ConfigError(
            f"server.draft=latest: {ws.root / 'current'} points at run {run}, which has no "
            f"verified merged draft at {merged}"
        )
    version = published_version(run_dir / "gate.json")
    return ServedDraft(str(merged), "promoted", version or run)


def _newest_merged(cfg: Config, ws: Workspace) -> ServedDraft | None:
    """The newest verified of <artifacts>/merged and the registry's latest version."""
    found: list[tuple[float, int, ServedDraft]] = []
    if is_verified(ws.merged):
        version = published_version(ws.merged / PUSH_RECORD)
        mtime = (ws.merged / "phoenix.json").stat().st_mtime
        found.append((mtime, 1, ServedDraft(str(ws.merged), "merged", version)))
    latest = _registry_model(cfg, ws) / "latest.json"
    if latest.is_file():
        version = json.loads(latest.read_text())["version"]
        folder = latest.parent / version
        if is_verified(folder):
            mtime = (folder / "phoenix.json").stat().st_mtime
            found.append((mtime, 0, ServedDraft(str(folder), "registry", version)))
    return max(found, key=lambda f: f[:2])[2] if found else None


def _explicit(cfg: Config, ws: Workspace, text: str) -> ServedDraft:
    if VERSION.match(text):
        root = _registry_model(cfg, ws)
        hits = sorted(d for d in root.glob(f"{text}*") if d.is_dir() and not d.name.startswith("."))
        if len(hits) != 1:
            known = sorted(d.name for d in root.glob("v*") if d.is_dir())
            raise ConfigError(
                f"server.draft={text}: {'no' if not hits else 'more than one'} registry version "
                f"matches under {root} (versions there: {', '.join(known) or 'none'})"
            )
        return ServedDraft(str(hits[0]), "explicit", hits[0].name)
    path = Path(text).expanduser()
    is_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not path.exists() and not is_hub_id:
        raise ConfigError(
            f"server.draft={text}: no such directory (nor a registry version or Hub id)"
        )
    version = None
    meta = path / "phoenix-version.json"
    if meta.is_file():
        version = json.loads(meta.read_text()).get("version")
    return ServedDraft(str(path) if path.exists() else text, "explicit", version)


def check_loadable(served: ServedDraft) -> None:
    """Exit 2 now, naming the draft, if its directory (or Hub id) cannot be loaded."""
    from transformers import AutoConfig

    path = Path(served.spec)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"draft {served.spec} is not a model directory")
        if not any((path / w).is_file() for w in WEIGHTS):
            raise ConfigError(f"draft {served.spec} holds no weights ({' / '.join(WEIGHTS)})")
    try:
        AutoConfig.from_pretrained(served.spec)
    except Exception as exc:  # noqa: BLE001 - any reason it cannot be read is the same error
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"draft {served.spec} cannot be loaded: {first}") from None


def bench_acceptance(ws: Workspace, served: ServedDraft, mode: str) -> ServedDraft:
    """The served draft with the held-out acceptance at `mode` a bench measured of its weights."""
    folder = Path(served.spec)
    wid = weights_id(folder) if folder.is_dir() else None
    found = measured_acceptance(ws.root, wid, mode) if wid else None
    if found is None:
        return served
    acc, results_file = found
    return replace(served, acceptance=acc, acceptance_mode=mode, acceptance_from=str(results_file))


def resolve_served(cfg: Config, ws: Workspace, which: str | None = None) -> ServedDraft:
    """`which` (default: `server.draft`, and only then the draft-or-head choice) -> the draft to
    serve, checked loadable, with its bench acceptance and the head beside it."""
    served = _resolve(cfg, ws, which)
    if which is None and cfg.trains_head():  # the server's choice: the faster of the two
        return _draft_or_head(ws, served)
    if cfg.models.head and not cfg.trains_head() and not is_eagle3(served.spec):
        served = replace(served, head=head_ref(cfg, ws))
    return served


def _resolve(cfg: Config, ws: Workspace, which: str | None) -> ServedDraft:
    text = (which or cfg.server.draft).strip()
    if text == "base":
        served = ServedDraft(cfg.models.draft, "base")
    elif text == "latest":
        served = _promoted(ws) or _newest_merged(cfg, ws)
        if served is None:
            log.warning(
                "server.draft=latest: no distilled draft under %s (no promoted run, no verified "
                "merged draft, no registry version): serving the base draft %s, which accepts "
                "little. Build one with `make demo` (or make distill train merge), then restart.",
                ws.root, cfg.models.draft,
            )  # fmt: skip
            return ServedDraft(cfg.models.draft, "base")
    else:
        served = _explicit(cfg, ws, text)
    if served.source != "base":
        check_loadable(served)
        served = bench_acceptance(ws, served, cfg.retrain.gate_mode)
    return served


def _draft_or_head(ws: Workspace, served: ServedDraft) -> ServedDraft:
    """models.head=distilled: the draft, the head, or both; `why` says which, by what figures."""
    head = ws.head().merged
    if not is_verified(head):
        return replace(
            served,
            why=f"models.head=distilled: no merged head at {head} yet (train and merge build "
            "it): the draft alone",
        )
    if is_eagle3(served.spec):  # server.draft names a head: nothing to choose
        return served
    both = replace(served, head=str(head))
    results = ws.bench_results
    measured = json.loads(results.read_text()) if results.is_file() else {}
    same = (measured.get("draft_weights") or {}).get("distilled") == weights_id(served.spec) and (
        measured.get("head_weights") == weights_id(head)
    )
    rows = [r for r in measured.get("rows", []) if r["draft"] == "distilled"] if same else []
    best = {
        kind: max((r for r in rows if r["mode"].startswith(prefix)), default=None,
                  key=lambda r: r["tokens_per_second"])
        for kind, prefix in (("draft", ("fixed_", "pard_")), ("head", ("eagle_",)))
    }  # fmt: skip
    if best["draft"] is None or best["head"] is None:
        return replace(
            both,
            why=f"no bench of this draft and head ({results}): both served, the bandit "
            "chooses per request",
        )
    d, h = best["draft"], best["head"]
    figures = (
        f"the bench of {measured['environment']['date']} measured the head's {h['mode']} at "
        f"{h['speedup']:.2f}x target-only and the draft's {d['mode']} at {d['speedup']:.2f}x"
    )
    if h["tokens_per_second"] > d["tokens_per_second"]:
        version = published_version(head / PUSH_RECORD)
        return ServedDraft(str(head), served.source, version, h.get("acceptance_rate"), h["mode"],
                           str(results), why=f"the EAGLE-3 head: {figures}")  # fmt: skip
    return replace(served, why=f"the draft model, not the EAGLE-3 head: {figures}")


def bench_prior(cfg: Config, ws: Workspace, served: ServedDraft | None) -> tuple[dict, str] | None:
    """The bandit's start (`bandit.bench_prior_rounds`) -> (prior, where from), or None: per
    strategy key (`draft`, `pard`, `eagle`, `ngram`; `@bucket` if sampled), (eligible, proposed,
    accepted) per position summed over the bench's requests of this target (and, for the draft's
    and the head's, of these exact weights)."""
    from .speculative.bandit import Context, strategy_of, temperature_bucket

    results = ws.bench_results
    if cfg.bandit.bench_prior_rounds <= 0 or not results.is_file():
        return None
    try:
        measured = json.loads(results.read_text())
        if measured.get("target_model") != cfg.models.target:
            return None
        temperature = float(measured["protocol"].get("temperature", 0.0))
        requests = measured["requests"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    weights: dict[str, str | None] = {"ngram": None}
    if served is not None:
        spec, head = Path(served.spec), served.head
        if is_eagle3(served.spec):
            spec, head = None, served.spec
        if spec is not None and spec.is_dir():  # its draft:K and pard:K arms alike
            weights["draft"] = weights["pard"] = weights_id(spec)
        if head is not None and Path(head).is_dir():
            weights["eagle"] = weights_id(Path(head))
    bucket = temperature_bucket(Context(temperature=temperature))
    sums: dict[str, list[list[float]]] = {}
    for r in requests:
        s = strategy_of(r.get("arm", "0"))
        if s not in weights:
            continue
        draft_weights = (measured.get("draft_weights") or {}).get(r.get("draft"))
        if s in ("draft", "pard") and draft_weights != weights[s]:
            continue
        if s == "eagle" and measured.get("head_weights") != weights[s]:
            continue
        prop, acc = r.get("proposed_per_position") or [], r.get("accepted_per_position") or []
        rounds = r.get("guess_rounds", r.get("rounds")) or 0
        elig = r.get("eligible_per_position") or [rounds] * len(prop)
        key = f"{s}@{bucket}" if bucket else s
        elig_p_a = sums.setdefault(key, [[], [], []])
        for part, values in enumerate((elig, prop, acc)):
            row = elig_p_a[part]
            row.extend([0.0] * (len(values) - len(row)))
            for i, x in enumerate(values):
                row[i] += x
    prior = {k: tuple(v) for k, v in sums.items() if v[0] and v[0][0] > 0}
    if not prior:
        return None
    date = measured.get("environment", {}).get("date", "?")
    return prior, f"the bench of {date} ({results}): {', '.join(sorted(prior))}"
