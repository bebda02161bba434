"""The config's sections for serving and its measurement: the bandit, the server, the step
loop's engine, the benchmark and vLLM.

Each class is one YAML section (`pipeline.config.Config` holds them all; the stages' sections
live there); its field names are the YAML keys. `Section`, every section's base, refuses
unknown keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .speculative.arms import FORMS, canonical


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BanditConfig(Section):
    arms: list[int | str] = Field(
        default_factory=lambda: ["0", "draft:2", "draft:4", "ngram:2", "ngram:4"],  # README
        description="Arms: 0 (no drafting), draft:K (the draft model, also written K), ngram:K "
        "(prompt lookup, no model); K in 1..16.",
    )
    warmup_pulls: int = Field(1, ge=0, description="Pulls of every arm before the schedule.")
    epsilon_start: float = Field(0.3, ge=0, le=1)
    epsilon_floor: float = Field(0.05, ge=0, le=1)
    epsilon_decay: float = Field(0.97, gt=0, le=1)
    policy: Literal["seed", "plausible", "contextual", "goodput"] = Field(
        "goodput",
        description="goodput: the arm with the best predicted goodput at the load the request "
        "joins (acceptance per position learnt from every request, the step loop's measured "
        "costs); seed: the seed's epsilon-greedy (uniform exploration); plausible: explore "
        "only arms that may still be the best (mean + z standard errors >= best mean); "
        "contextual: plausible, with values per prompt-length, load and recent-acceptance cell.",
    )
    explore_margin: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="goodput: exploration picks among arms predicted within this fraction of "
        "the best at the request's load.",
    )
    speculate_margin: float = Field(
        0.05,
        ge=0,
        description="goodput: beside other rows, a speculative arm is chosen (or explored), and "
        "a bandit row guesses in a step, only if predicted to beat plain by this fraction; "
        "alone, every arm competes and guesses. This is the margin at 2 rows; it grows by "
        "speculate_margin_per_row for every row past two.",
    )
    speculate_margin_per_row: float = Field(
        0.05,
        ge=0,
        description="goodput: what speculate_margin grows by for every row past two (the "
        "prediction of a step errs more, towards guessing, as rows grow: docs/serving.md). "
        "0: one margin at every load.",
    )
    bench_prior_rounds: int = Field(
        200,
        ge=0,
        description="goodput: the server's bandit starts from the acceptance per position the "
        "workspace's bench measured on these exact weights, weighted as this many rounds (live "
        "requests outweigh it within a few); its warm-up skips the arms it covers once the "
        "step loop has timed their steps at start-up. 0: every arm is pulled once first.",
    )
    save_every_s: float = Field(
        5.0, ge=0, description="Write the bandit's state file at most this often (and at exit)."
    )
    z: float = Field(2.0, gt=0, description="Standard errors of slack for plausible exploration.")
    prior_weight: float = Field(
        4.0, gt=0, description="contextual: in-cell rewards that weigh as much as the global mean."
    )
    fallback: bool = Field(
        True,
        description="Fall back to plain generation when the exploited speculative arms' recent "
        "tokens/s is below plain generation's by fallback_margin (then probe to recover).",
    )
    fallback_margin: float = Field(0.2, ge=0, lt=1, description="Fraction below plain.")
    fallback_window: int = Field(8, ge=1, description="Recent requests compared, per side.")
    fallback_min_samples: int = Field(3, ge=1, description="Speculative requests before judging.")
    fallback_cooldown: int = Field(
        10,
        ge=1,
        description="Bandit requests served plain after a fallback (doubles if the probe fails).",
    )
    seed: int = 0

    @field_validator("arms")
    @classmethod
    def _arms_valid(cls, arms: list[int | str]) -> list[str]:
        out = canonical(arms)
        if not out or len(set(out)) != len(out):
            raise ValueError(f"arms must be distinct and at least one ({FORMS})")
        return out


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    mode: str = Field("bandit", description="target | fixed:K | bandit")
    reload_poll_s: float = Field(
        5.0,
        ge=0,
        description="server.draft=latest: check <artifacts>/current this often and swap in a "
        "newly promoted draft (0: only on POST /admin/reload-draft).",
    )
    draft: str = Field(
        "latest",
        description="The draft served: latest (the promoted draft, else the newest verified "
        "merged one, else the base draft with a warning), base (models.draft), or a registry "
        "version (v0003), a directory or a Hub id.",
    )
    queue_size: int = Field(32, ge=1, description="Requests waiting or running before 429.")
    max_batch: int = Field(
        16,
        ge=1,
        description="Rows the step loop advances together (every arm; the rest wait to join).",
    )
    max_body_kb: int = Field(
        1024,
        ge=1,
        description="Request bodies over this size are refused with 413 before they are read.",
    )
    api_key_env: str = Field("PHOENIX_API_KEY", description="Env var; when set, bearer auth.")
    allow_unauthenticated_admin: bool = Field(
        False,
        description="Without an API key on an address other than loopback, POST /admin/* is "
        "refused (403 admin_disabled) unless this is true.",
    )
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens accepted.")
    shutdown_timeout_s: float = Field(
        10.0,
        gt=0,
        description="On SIGTERM/Ctrl-C: how long running requests may finish before they are "
        "cancelled.",
    )
    stuck_after_s: float = Field(
        60.0,
        gt=0,
        description="/health answers 503 once generation has made no progress for this long.",
    )


class EngineConfig(Section):
    compile: Literal["auto", "true", "false"] = Field(
        "false",
        description="torch.compile each model's whole pass as one graph (and an EAGLE-3 head's "
        "dense parts). auto: keep it only where a measurement at start-up finds it faster than "
        "eager, else eager (one warning where compiling fails); true: compile, fail loudly; "
        "false: eager.",
    )
    backend: str = Field(
        "inductor",
        description="torch.compile backend (inductor generates kernels; aot_eager, used by the "
        "tests, traces without generating any).",
    )
    max_context: int = Field(
        1024,
        ge=64,
        description="The longest a request may grow, prompt + output (tokens): the server "
        "refuses a request whose prompt plus max_tokens passes it. Each model's per-row KV "
        "cache grows by doubling up to it; a step attends only over the columns its rows use.",
    )
    draft_vocab: int = Field(
        0,
        ge=0,
        description="The draft proposes only among the N most frequent tokens of the training "
        "answers (recorded by the train stage); 0: the full vocabulary.",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_bool(cls, v: Any) -> Any:
        return str(v).lower() if isinstance(v, bool) else v  # YAML reads `true` as a bool


class BenchConfig(Section):
    max_new_tokens: int = Field(128, ge=1)
    lossless_margin: float | None = Field(
        None,
        ge=0,
        description="A speculative output may leave the target-only output only where the "
        "target's own scores for the two tokens differ by at most this (a numerical near-tie "
        "of batched vs one-token rounding); null: by the dtype that ran, 0 in float32 and 0.5 "
        "in bfloat16/float16.",
    )
    prompts: int | None = Field(None, ge=1, description="Held-out prompts to use; null: all.")
    fixed_arms: list[int | str] = Field(
        default_factory=lambda: ["draft:4", "ngram:4"],
        description="Arms measured alone, as rows fixed_K (draft:K, also written K) and ngram_K.",
    )
    drafts: list[str] = Field(
        default_factory=lambda: ["base", "distilled"],
        description="base (models.draft), distilled (<artifacts>/merged), or a directory: a "
        "merged draft, or an exported EAGLE-3 head (its rows: the eagle:K arms of fixed_arms "
        "and bandit.arms).",
    )
    bandit_state: Literal["fresh", "persist"] = Field(
        "fresh",
        description="fresh: each bandit run starts from nothing; persist: bench/bandit-<draft>.json",
    )
    warmup_requests: int = Field(
        1, ge=0, description="Requests per run excluded from every figure."
    )
    seed_bandit: bool = Field(
        False,
        description="Also run the seed's bandit (bandit.policy=seed) on the same prompts, "
        "reported as mode bandit_seed.",
    )
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="0: the greedy protocol (every output checked token for token against "
        "target-only). Above: the sampled protocol: every request samples (seeded by prompt), and "
        "the outputs are checked in distribution (distribution_prompts x distribution_samples).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="The sampled protocol's top_p.")
    top_k: int = Field(0, ge=0, description="The sampled protocol's top_k (0: off).")
    distribution_prompts: int = Field(
        3, ge=0, description="Sampled protocol: prompts whose first tokens are compared."
    )
    distribution_samples: int = Field(
        200, ge=10, description="Sampled protocol: generations per arm and prompt compared."
    )

    @field_validator("fixed_arms")
    @classmethod
    def _fixed_valid(cls, arms: list[int | str]) -> list[str]:
        return [a for a in dict.fromkeys(canonical(arms)) if a != "0"]  # target always runs


class VllmConfig(Section):
    python: str | None = Field(
        None,
        description="An interpreter with vLLM installed; null: .venv-vllm/bin/python (make vllm).",
    )
    dtype: str = Field("auto", description="vLLM's --dtype; auto: models.dtype as Phoenix runs it.")
    max_model_len: int = Field(1024, ge=64, description="vLLM's --max-model-len.")
    threads: int | None = Field(
        None, ge=1, description="OMP_NUM_THREADS for vLLM on a CPU; null: every core."
    )
    kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE (CPU), GiB.")
    reserved_cpus: int | None = Field(
        None,
        ge=0,
        description="VLLM_CPU_NUM_OF_RESERVED_CPU: cores vLLM keeps from its engine for its "
        "front end (null: vLLM's default, one per engine).",
    )
    startup_timeout_s: float = Field(900.0, gt=0, description="Wait this long for /health.")
    extra_args: list[str] = Field(default_factory=list, description="More vLLM arguments.")
    k: int = Field(
        2,
        ge=1,
        description="serve --engine vllm without a learned schedule: draft tokens per step.",
    )
    tune_ks: list[int] = Field(
        default_factory=lambda: [0, 1, 2, 4],
        description="tune-vllm: the draft model's ks measured (0: no speculation, always).",
    )
    tune_ngram_ks: list[int] = Field(
        default_factory=lambda: [2, 4],
        description="tune-vllm: vLLM's prompt lookup (ngram) at these ks ([]: not measured).",
    )
    tune_concurrency: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16], description="tune-vllm: concurrent clients."
    )
    tune_prompts: int = Field(
        32, ge=1, description="tune-vllm: requests per point (at least 2 per client)."
    )
    tune_margin: float = Field(
        0.03,
        ge=0,
        description="tune-vllm: a k > 0 enters the schedule only where it beats no speculation "
        "by more than this fraction (a smaller win is within a sweep's noise).",
    )
    tune_max_tokens: int = Field(48, ge=1, description="tune-vllm: max_tokens per request.")

    @field_validator("tune_ks")
    @classmethod
    def _ks(cls, ks: list[int]) -> list[int]:
        if not ks or any(k < 0 for k in ks) or 0 not in ks or len(set(ks)) != len(ks):
            raise ValueError("distinct ks >= 0, 0 (no speculation) among them")
        return sorted(ks)

    @field_validator("tune_ngram_ks")
    @classmethod
    def _ngram_ks(cls, ks: list[int]) -> list[int]:
        if any(k < 1 for k in ks) or len(set(ks)) != len(ks):
            raise ValueError("distinct ks >= 1")
        return sorted(ks)

    @field_validator("tune_concurrency")
    @classmethod
    def _levels(cls, cs: list[int]) -> list[int]:
        if not cs or any(c < 1 for c in cs) or len(set(cs)) != len(cs):
            raise ValueError("distinct client counts >= 1")
        return sorted(cs)
