"""Benchmark: did distillation make the draft better, and does speculation pay here?

    python -m pipeline bench --config configs/default.yaml [--draft base|distilled|both]
                                                                    (or: make bench)

Each prompt set of `bench.sets` (held-out prompts first, by default) through the serving core,
batch size 1, every mode taking turns prompt by prompt (protocol: docs/pipeline.md), the models
loaded once for every set. Greedy: every speculative output must equal the target-only output
token for token; sampled (`bench.temperature` > 0): in distribution (`DistributionCheck`); each
set checked on its own. Exit 4 if not. Writes <artifacts>/bench/results.json (the first set's
summary at the top level, every set's under "sets"), report.md and PNG plots.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from . import compiling, data, models, report
from .artifacts import weights_id
from .config import Config
from .errors import InputError, VerificationError
from .loadtest import load_sets
from .serving import heap
from .serving.core import ServingCore, make_core
from .serving.request import Request, fixed, parse_mode
from .speculative.arms import parse_arm, usable
from .speculative.batch import sample_outputs
from .speculative.sampling import GREEDY, Sampling, chi_square
from .workspace import Workspace, atomic_write_json, atomic_write_text

log = logging.getLogger(__name__)


def hardware() -> str:
    import torch

    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{models.cpu_name()}, {os.cpu_count()} cores{gpu}"


def environment(cfg: Config, device: str, dtype: str | None = None) -> dict[str, Any]:
    """Machine, device, the dtype that ran (default: `models.dtype` as set), threads, versions."""
    import torch
    import transformers

    from . import __version__

    return {
        "hardware": hardware(),
        "device": device,
        "dtype": dtype or str(models.pick_dtype(cfg.models.dtype, device)).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "phoenix": __version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def prompt_ids(cfg: Config, tok, rows: list[dict]) -> list[list[int]]:
    """Each row's prompt ids as the server renders its request (`data.bench_messages`: an MBPP
    row is its one user message); captured traffic: as served."""
    kwargs = cfg.template_kwargs()
    return [
        r.get("prompt_token_ids") or models.chat_prompt_ids(tok, data.bench_messages(r), kwargs)
        for r in rows
    ]


def run(cfg: Config, ws: Workspace, telemetry, drafts: list[str] | None = None) -> dict[str, Any]:
    """Measure every (set, draft, mode), check every output against target-only, summarise."""
    drafts = drafts or list(cfg.bench.drafts)
    if cfg.models.draft.strip() == "eagle3" and "base" in drafts:  # a head has no base
        drafts = [d for d in drafts if d != "base"] or ["distilled"]
        log.info("models.draft=eagle3: no base head to bench; benching %s", ", ".join(drafts))
    if "distilled" in drafts and not (ws.merged / "config.json").is_file():
        raise InputError(
            f"no distilled draft at {ws.merged}: run train and merge first, or bench with --draft base"
        )
    head = models.head_ref(cfg, ws)  # resolved first: a missing head fails before any row
    sets = load_sets(cfg, ws)
    target = models.load_pair(cfg, ws, None)
    engines = {"none": {"compiled": compiling.compile_engine(cfg, ws, target)}}
    pairs = load_drafts(cfg, ws, drafts, target, engines)
    measured = {
        name: measure_set(cfg, ws, telemetry, drafts, pairs, target, rows, engines)
        for name, rows in sets.items()
    }
    results, records = combine(measured, cfg.bench.sets[0])
    # Which weights each row measured: the server names a draft's acceptance only for these.
    results["draft_weights"] = {d: engines[d]["weights"] for d in drafts}
    results["head_weights"] = weights_id(head) if head else None
    ws.bench.mkdir(parents=True, exist_ok=True)
    atomic_write_json(ws.bench_results, results)
    text = report.markdown(results)
    atomic_write_text(ws.bench / "report.md", text)
    report.write_plots(results, records, ws.bench)
    log.info("bench: report at %s\n%s", ws.bench / "report.md", text)
    if results["mismatches"]:
        raise VerificationError(
            f"lossless check failed for {len(results['mismatches'])} outputs: "
            + "; ".join(results["mismatches"][:5])
        )
    return {"lossless": True, "rows": len(results["rows"])}


def measure_set(
    cfg: Config, ws: Workspace, telemetry, drafts, pairs, target, rows, engines: dict
) -> tuple[dict[str, Any], list[dict]]:
    """One prompt set through the protocol and its lossless check -> (its summary, records)."""
    ids = prompt_ids(cfg, target.tokenizer, rows)
    check = DistributionCheck(cfg, ids) if sampled(cfg) else None
    records = measure_all(cfg, ws, telemetry, pairs, rows, target, ids, check)
    dtype = str(target.target.dtype).replace("torch.", "")
    margin = lossless_margin(cfg, dtype)
    distribution = check.result() if check is not None else None
    if distribution is not None:
        mismatches, near_ties = distribution["failures"], []
    else:
        mismatches, near_ties = check_lossless(records, target, ids, margin)
    summary = summarise(cfg, ws, drafts, records, mismatches, near_ties, dtype, margin)
    summary["distribution"] = distribution
    summary["engine"] = engine_summary(cfg, records, engines)
    return summary, records


def combine(measured: dict[str, tuple[dict, list[dict]]], first: str) -> tuple[dict, list[dict]]:
    """results.json: the first set's summary at the top level (what the gate, the server and
    the plots read), every set's (less the shared environment) under "sets"; `lossless`,
    `identical` and `mismatches` (a later set's named) cover every set -> (results, the first
    set's records)."""
    results, records = measured[first]
    results = dict(results)
    results["sets"] = {
        name: {k: v for k, v in s.items() if k != "environment"}
        for name, (s, _) in measured.items()
    }
    results["lossless"] = all(s["lossless"] for s, _ in measured.values())
    results["identical"] = all(s["identical"] for s, _ in measured.values())
    results["mismatches"] = [
        m if name == first else f"{name}: {m}"
        for name, (s, _) in measured.items()
        for m in s["mismatches"]
    ]
    return results, records


def sampled(cfg: Config) -> bool:
    return cfg.bench.temperature > 0


def sampling_of(cfg: Config, prompt_index: int) -> Sampling:
    """Greedy, or bench.temperature seeded by the prompt (the same seed in every mode)."""
    b = cfg.bench
    if not sampled(cfg):
        return GREEDY
    return Sampling(b.temperature, b.top_p, b.top_k, seed=cfg.data.seed * 100_003 + prompt_index)


DISTRIBUTION_TOKENS = 3  # output positions compared by the sampled protocol
DISTRIBUTION_ALPHA = 1e-3  # family-wise: each comparison is judged at ALPHA / comparisons


class DistributionCheck:
    """The sampled protocol's check: per prompt (bench.distribution_prompts) and position (the
    first DISTRIBUTION_TOKENS), bench.distribution_samples tokens of each arm vs the target
    alone, a two-sample chi-square test. Fails below DISTRIBUTION_ALPHA / comparisons (Bonferroni: a correct engine fails with
    probability at most DISTRIBUTION_ALPHA)."""

    def __init__(self, cfg: Config, ids: list[list[int]]):
        b = cfg.bench
        self.n, self.prompts = b.distribution_samples, ids[: b.distribution_prompts]
        self.base = sampling_of(cfg, 0)
        self.reference: list[list] | None = None  # target-only samples per prompt
        self.rows: list[dict] = []
        self.runs = 0  # seeds apart for every (engine, arm) compared

    def _samples(self, engine, arm: str, i: int) -> tuple[list, int]:
        s = replace(self.base, seed=self.runs * 1_000_003 + i * 10_007)
        return sample_outputs(engine, self.prompts[i], parse_arm(arm), self.n,
                              DISTRIBUTION_TOKENS, s)  # fmt: skip

    def compare(self, name: str, engine, arms: list[str]) -> None:
        """Compare each of `arms` on `engine` (draft `name`) with target-only sampling."""
        if self.reference is None:  # the target alone, on the first engine compared
            self.reference = [self._samples(engine, "0", i)[0] for i in range(len(self.prompts))]
        for arm in arms:
            self.runs += 1
            for i in tqdm(range(len(self.prompts)), desc=f"bench distribution {name}/{arm}",
                          unit="prompt", dynamic_ncols=True):  # fmt: skip
                outs, proposed = self._samples(engine, arm, i)
                for pos in range(DISTRIBUTION_TOKENS):
                    stat, p = chi_square([o[pos] for o in outs],
                                         [o[pos] for o in self.reference[i]])  # fmt: skip
                    self.rows.append({"draft": name, "arm": arm, "prompt_index": i,
                                      "position": pos, "chi2": stat, "p_value": p,
                                      "proposed": proposed})  # fmt: skip

    def result(self) -> dict[str, Any]:
        threshold = DISTRIBUTION_ALPHA / max(1, len(self.rows))
        failures = [
            f"{r['draft']}/{r['arm']} prompt {r['prompt_index']} position {r['position']}: "
            f"p = {r['p_value']:.2e} < {threshold:.1e} (its tokens are not distributed as the "
            "target's)"
            for r in self.rows
            if r["p_value"] < threshold
        ]
        return {
            "samples": self.n,
            "prompts": len(self.prompts),
            "tokens": DISTRIBUTION_TOKENS,
            "alpha": DISTRIBUTION_ALPHA,
            "threshold": threshold,
            "min_p_value": min((r["p_value"] for r in self.rows), default=None),
            "comparisons": self.rows,
            "failures": failures,
        }


def free_arms(cfg: Config) -> list[str]:
    """The measured arms that need neither a draft model nor a head (ngram:K)."""
    return [a for a in cfg.bench.fixed_arms if usable(a, False, False)]


def draft_spec(cfg: Config, ws: Workspace, draft: str) -> str:
    """base, distilled, or a directory (a merged draft or an exported head) -> its model spec."""
    return {"base": cfg.models.draft, "distilled": str(ws.merged)}.get(draft, draft)


def load_drafts(cfg: Config, ws: Workspace, drafts, target, engines: dict) -> dict:
    """Every draft loaded beside the shared target -> {draft: pair}. Fills `engines[draft]`
    (compiled, head subset, weights id)."""
    pairs = {}
    for draft in drafts:
        pair = models.load_pair(cfg, ws, draft_spec(cfg, ws, draft), share_target=target)
        engines[draft] = {
            "compiled": compiling.compile_engine(cfg, ws, pair),
            "head_ids": pair.models.draft_head_ids,
            "weights": weights_id(pair.draft_ref),
        }
        pairs[draft] = pair
    return pairs


def measure_all(
    cfg: Config, ws: Workspace, telemetry, pairs: dict, rows, target, ids,
    check: DistributionCheck | None = None,
) -> list[dict]:  # fmt: skip
    """One record per (draft, mode, prompt) of one set, on cores built for it (a fresh bandit
    per set unless `bench.bandit_state` persists); `check` runs while the models are loaded."""

    def core_of(pair: models.Pair, draft: str | None, state=None, policy=None) -> ServingCore:
        mode = "bandit" if draft else "target"  # batch size 1: the protocol
        # Not started: every step runs on the thread that loaded the models (docs/serving.md).
        return make_core(cfg, pair, mode, draft, state_file=state, max_batch=1, policy=policy,
                         start=False)  # fmt: skip

    plain = core_of(target, None)
    cores = [plain]
    runs = [(plain, "none", "target", None)]
    runs += [(plain, "none", fixed(arm).spec, None) for arm in free_arms(cfg)]
    compares = [("none", target.models, free_arms(cfg))]
    for draft, pair in pairs.items():
        state = ws.bench / f"bandit-{draft}.json" if cfg.bench.bandit_state == "persist" else None
        core = core_of(pair, draft, state=state)
        cores.append(core)
        own = [a for a in cfg.bench.fixed_arms if not usable(a, False, False)
               and usable(a, *core.kinds)]  # fmt: skip
        runs += [(core, draft, fixed(arm).spec, None) for arm in own]
        runs.append((core, draft, "bandit", None))
        compares.append((draft, pair.models, own))
        if cfg.bench.seed_bandit:
            seed = core_of(pair, draft, policy="seed")
            cores.append(seed)
            runs.append((seed, draft, "bandit", "bandit_seed"))
    try:
        records = interleave(cfg, telemetry, runs, ids, rows)
        if check is not None:
            for draft, engine, arms in compares:
                check.compare(draft, engine, arms)
    finally:
        for core in cores:
            core.close()
    return records


def interleave(cfg, telemetry, runs, ids, rows) -> list[dict]:
    """Warm every run, then each prompt to every run in turn, the order reversed every other
    prompt (drift falls on every mode alike). Returns records run by run, in prompt order."""
    modes = [warm_up(cfg, core, mode_text, ids) for core, _, mode_text, _ in runs]
    out: list[list[dict]] = [[] for _ in runs]
    order = list(range(len(runs)))
    heap.freeze()  # a full collection inside a timed request would walk the models' heap
    try:
        with tqdm(total=len(ids) * len(runs), desc="bench", unit="req", dynamic_ncols=True) as bar:
            for i, p in enumerate(ids):
                for j in order if i % 2 == 0 else order[::-1]:
                    core, draft, _, label = runs[j]
                    out[j].append(
                        measure_one(cfg, telemetry, core, modes[j], draft, label, i, p, rows)
                    )
                    bar.update()
    finally:
        heap.release()
    return [r for run in out for r in run]


def warm_up(cfg, core: ServingCore, mode_text: str, ids):
    """A run's mode, after warm-up requests on every arm it can use (fixed modes: the bandit's
    state is untouched)."""
    arms = (
        core.bandit.arms
        if mode_text == "bandit"
        else list(dict.fromkeys(["0", *cfg.bandit.arms, *cfg.bench.fixed_arms]))
    )
    mode = parse_mode(mode_text, arms, *core.kinds)
    warm_modes = [fixed(a) for a in core.bandit.arms] if mode.kind == "bandit" else [mode]
    for w in range(cfg.bench.warmup_requests):
        for warm in warm_modes:
            core.generate(Request(ids[w % len(ids)], min(16, cfg.bench.max_new_tokens), warm,
                                  sampling=sampling_of(cfg, w)))  # fmt: skip
    return mode


def measure_one(cfg, telemetry, core, mode, draft, label, i: int, prompt, rows) -> dict:
    with telemetry.request(mode, core.draft_id) as rec:
        res = core.generate(
            Request(prompt, cfg.bench.max_new_tokens, mode, sampling=sampling_of(cfg, i))
        )
        rec.record(res)
    return {
        **res.record(),
        "draft": draft,  # the bench's name for it: base, distilled (none: no draft)
        "mode": label or mode.name,  # the row: target, fixed_4, ngram_4, bandit, bandit_seed
        "prompt_index": i,
        "task_id": rows[i]["task_id"],
        "token_ids": res.result.token_ids,
    }


def check_lossless(records, target, ids, margin: float) -> tuple[list[str], list[dict]]:
    """Each speculative output vs its prompt's target-only output -> (mismatches, near_ties).
    Where they first part, the target scores both choices; a gap <= `margin` is a near-tie."""
    reference = {r["prompt_index"]: r for r in records if r["mode"] == "target"}
    eos = sorted(target.models.eos_token_ids)
    mismatches, near_ties = [], []
    for r in records:
        ref = reference[r["prompt_index"]]
        if r["mode"] == "target" or r["token_ids"] == ref["token_ids"]:
            continue
        at = _first_diff(r["token_ids"], ref["token_ids"])
        where = f"{r['draft']}/{r['mode']} prompt {r['prompt_index']} (task {r['task_id']})"
        wanted, got = _choice(ref, at, eos), _choice(r, at, eos)
        if wanted is None or got is None:  # cut by max_tokens, not a choice the target made
            mismatches.append(f"{where}: output length differs from target-only at token {at}")
            continue
        scores = _scores(target.target, ids[r["prompt_index"]] + ref["token_ids"][:at])
        gap = _score_of(scores, wanted) - _score_of(scores, got)
        tie = {
            "draft": r["draft"],
            "mode": r["mode"],
            "prompt_index": r["prompt_index"],
            "position": at,
            "target_token": wanted,
            "token": got,
            "margin": gap,
        }
        if gap <= margin:
            near_ties.append(tie)
        else:
            mismatches.append(
                f"{where}: output differs from target-only at token {at} (target prefers its "
                f"choice by {gap:.4f} > bench.lossless_margin {margin})"
            )
    return mismatches, near_ties


def _choice(record: dict, at: int, eos: list[int]) -> int | list[int] | None:
    """A record's choice at `at`: a token id, the eos ids (it stopped), or None (cut)."""
    if at < len(record["token_ids"]):
        return record["token_ids"][at]
    return eos if record["finish_reason"] == "stop" else None


def _scores(model, prefix: list[int]):
    """The target's next-token scores after `prefix` (one pass, fp32)."""
    import torch

    with torch.inference_mode():
        dev = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([prefix], device=dev), logits_to_keep=1).logits
    return logits[0, -1].float()


def _score_of(scores, choice: int | list[int]) -> float:
    return float(scores[choice].max()) if isinstance(choice, list) else float(scores[choice])


def engine_summary(cfg: Config, records: list[dict], engines: dict) -> dict[str, Any]:
    """How the engines ran; each pruned draft head's coverage of the target-only outputs."""
    answers = [t for r in records if r["mode"] == "target" for t in r["token_ids"]]
    out: dict[str, Any] = {"compile": cfg.engine.compile, "draft_vocab": cfg.engine.draft_vocab}
    for draft, info in engines.items():
        row = {"compiled": info["compiled"]}
        head = info.get("head_ids")
        if head is not None:
            inside = set(head)
            row["head_tokens"] = len(inside)
            row["heldout_coverage"] = (
                sum(t in inside for t in answers) / len(answers) if answers else None
            )
        out[draft] = row
    return out


def lossless_margin(cfg: Config, dtype: str) -> float:
    """`bench.lossless_margin`, or when unset 0 in float32, 0.5 in half precision."""
    if cfg.bench.lossless_margin is not None:
        return cfg.bench.lossless_margin
    return 0.0 if dtype == "float32" else 0.5


def summarise(
    cfg, ws, drafts, records, mismatches, near_ties=(), dtype=None, margin=None
) -> dict[str, Any]:
    """results.json: rows per (draft, mode), distillation gain, bandit figures, every request."""
    result_rows = report.build_rows(records)
    acceptance = {(r["draft"], r["mode"]): r["acceptance_rate"] for r in result_rows}
    gains = {}
    for mode in dict.fromkeys(r["mode"] for r in result_rows if r["draft"] == "distilled"):
        b, d = acceptance.get(("base", mode)), acceptance.get(("distilled", mode))
        if b is not None and d is not None:
            gains[mode] = {"base": b, "distilled": d, "gain": d - b}
    device = models.pick_device(cfg.models.device)
    return {
        "lossless": not mismatches,  # no difference beyond a near-tie (what the gate reads)
        "identical": not mismatches and not near_ties,  # no difference at all
        "mismatches": mismatches,
        "near_ties": list(near_ties),
        "lossless_margin": lossless_margin(cfg, dtype or "float32") if margin is None else margin,
        "environment": environment(cfg, device, dtype),
        "protocol": {
            "prompts": len({r["prompt_index"] for r in records}),
            "max_new_tokens": cfg.bench.max_new_tokens,
            "warmup_requests": cfg.bench.warmup_requests,
            "fixed_arms": cfg.bench.fixed_arms,
            "bandit_arms": cfg.bandit.arms,
            "bandit_state": cfg.bench.bandit_state,
            "bandit_policy": cfg.bandit.policy,
            "temperature": cfg.bench.temperature,
            "top_p": cfg.bench.top_p,
            "top_k": cfg.bench.top_k,
        },
        "drafts": drafts,
        "draft_models": {d: draft_spec(cfg, ws, d) for d in drafts},
        "target_model": cfg.models.target,
        "rows": result_rows,
        "distillation_gain": gains,
        "bandit": {d: report.bandit_summary(records, d) for d in drafts},
        "bandit_seed": {d: report.bandit_summary(records, d, "bandit_seed") for d in drafts}
        if cfg.bench.seed_bandit
        else {},
        "position_acceptance": report.position_acceptance(records),
        "requests": [{k: v for k, v in r.items() if k != "token_ids"} for r in records],
    }


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
