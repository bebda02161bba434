"""Typed configuration: YAML files whose keys are exactly these field names.

`Config` holds one section per YAML mapping (serving's in `config_serving.py`), the rules that
span sections, loading a file and `--set key.path=value` overrides. Unknown keys and wrong
types are errors naming the key and the file. Fields ending in `_env` name the environment
variable holding a secret.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from .config_serving import (
    BanditConfig,
    BenchConfig,
    EngineConfig,
    Section,
    ServerConfig,
    VllmConfig,
)
from .errors import ConfigError
from .workspace import LOCK_HEARTBEAT_S, LOCK_STALE_AFTER_S

HEAD_DISTILLED = "distilled"  # models.head: the head this workspace trains beside the draft


class ModelsConfig(Section):
    target: str = Field(
        "embedded:smollm2-135m-instruct",
        description="Hub id, local directory, `embedded:smollm2-135m-instruct`, or "
        "`tiny:key=value,...` (random test model).",
    )
    draft: str = Field(
        "cut:4",
        description="Spec forms as target, or `cut:N` / `cut:0,2,4` (the target's first N or "
        "listed layers), or `eagle3`: an EAGLE-3 head trained on the target's hidden states "
        "(needs its weights), exported in the speculators format.",
    )
    head: str | None = Field(
        None,
        description="An exported EAGLE-3 head served beside the draft (the eagle:K arms); "
        "`distilled`: the one this workspace trains beside it (<artifacts>/head/), served if "
        "the bench measured it faster.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: bfloat16 on a GPU; on a CPU float32, or bfloat16 where a probe finds "
        "it faster (serving).",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    served_name: str | None = Field(None, description="Model id served; default: the target spec.")


class DataConfig(Section):
    source: str = Field(
        "../shared/data/mbpp.jsonl",
        description="A JSONL file (MBPP, prompts, chat or ShareGPT; relative: to the working "
        "directory) or a Hub dataset id. PHOENIX_MBPP wins for MBPP: with format mbpp, or auto "
        "and this default source.",
    )
    format: Literal["auto", "mbpp", "prompts", "chat", "sharegpt", "traffic"] = Field(
        "auto",
        description="auto: mbpp if the file's first row has task_id, text and test_list, else "
        "the shape of its first line's keys (prompt, messages, conversations); a Hub id is MBPP "
        "unless data.columns is set. traffic: what the server captured.",
    )
    hub_config: str = Field("full", description="MBPP's Hub config.")
    hub_split: str = Field("train", description="The split of a Hub dataset other than MBPP.")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="A Hub dataset's columns by the keys a format reads, e.g. "
        "{prompt: question} or {messages: dialog}.",
    )
    skip_invalid: bool = Field(
        False,
        description="Skip (and count) conversations with an unknown role, no user turn or an "
        "empty content instead of failing.",
    )
    seed: int = 42
    train_size: int | float = Field(
        500,
        gt=0,
        description="Training rows: a number, or (not MBPP) a fraction in (0, 1) of the unique rows.",
    )
    test_size: int | float = Field(
        50,
        gt=0,
        description="Held-out rows: a number, or (not MBPP) a fraction in (0, 1) of the unique rows.",
    )
    max_context: int = Field(
        2048,
        ge=16,
        description="distill: tokens a conversation may fill (history + teacher.max_tokens); "
        "later turns are dropped with a warning",
    )

    @field_validator("train_size", "test_size")
    @classmethod
    def _count_or_fraction(cls, value: int | float) -> int | float:
        if isinstance(value, float) and not value < 1:
            raise ValueError("a whole number of rows, or a fraction in (0, 1)")
        return value


class TeacherConfig(Section):
    url: str = Field("local", description="OpenAI-compatible base URL, or `local`.")
    model: str | None = Field(None, description="Model id to ask for; default: the target spec.")
    api_key_env: str = Field("PHOENIX_TEACHER_API_KEY", description="Env var with the API key.")
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(
        0.0, ge=0.0, le=2.0, description="0: greedy; above: sampled, seeded by task_id."
    )
    enable_thinking: bool | None = Field(
        False, description="Sent as chat_template_kwargs.enable_thinking; null: not sent."
    )
    concurrency: int = Field(1, ge=1)
    return_token_ids: bool = Field(
        False, description="Ask a remote teacher for the answers' ids (vLLM's return_token_ids)."
    )
    ready_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    max_retries: int = Field(5, ge=0, description="Retries per request.")
    retry_budget: int = Field(100, ge=0, description="Retries for the whole stage.")


class DistillConfig(Section):
    limit: int | None = Field(None, ge=1, description="Answer only the first N train prompts.")
    extra_samples: int = Field(
        0,
        ge=0,
        le=16,
        description="Extra answers per prompt, sampled at sample_temperature, trained on too.",
    )
    sample_temperature: float = Field(
        0.6, gt=0, le=2, description="The extra samples' temperature."
    )
    turns: Literal["all", "last"] = Field(
        "all",
        description="Conversations: answer every user turn with the teacher's own earlier answers "
        "in the history (all), or only the last, earlier assistant turns kept as given (last).",
    )


class TrainConfig(Section):
    method: Literal["lora", "full"] = Field(
        "lora", description="lora: a PEFT adapter; full: every weight (for cut drafts)."
    )
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: str | list[str] = Field("all-linear", description="PEFT target modules.")
    learning_rate: float = Field(2e-4, gt=0)
    epochs: float = Field(1.0, gt=0)
    max_steps: int = Field(-1, description="Stop after this many optimizer steps; -1: by epochs.")
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    max_length: int = Field(512, ge=8)
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    seed: int = 0
    save_steps: int = Field(50, ge=1, description="Checkpoint every N steps (resume point).")
    objective: Literal["sft", "kd", "on_policy"] = Field(
        "sft",
        description="sft: the teacher's answer tokens; kd: the target's distribution on them; "
        "on_policy: its distribution on the draft's own continuations too.",
    )
    divergence: Literal["forward_kl", "reverse_kl", "tv", "jsd"] = Field(
        "forward_kl", description="kd/on_policy: KL(p||q), KL(q||p), total variation, or JSD."
    )
    kd_source: Literal["auto", "target", "teacher"] = Field(
        "auto",
        description="kd's distribution: target (its weights), teacher (the endpoint's "
        "top_logprobs); auto: teacher if teacher.url is remote and top_logprobs set.",
    )
    top_logprobs: int | None = Field(
        None,
        ge=1,
        le=20,
        description="kd/on_policy: only the target's top N per position (the rest one bucket); "
        "null: the full distribution (eagle3: 20).",
    )
    ttt_steps: int = Field(4, ge=1, le=8, description="eagle3: training-time-test steps.")
    eagle3_layers: list[int] | None = Field(
        None, description="eagle3: the three target layers fused; null: 2, L/2, L-3 (as vLLM)."
    )
    head_epochs: float = Field(8.0, gt=0, description="models.head=distilled: the head's epochs.")
    head_learning_rate: float = Field(
        1e-3, gt=0, description="models.head=distilled: the head's learning rate."
    )
    include_reasoning: bool = Field(
        False, description="Train on a teacher's reasoning_content too (as <think>...</think>)."
    )
    on_policy_ratio: float = Field(
        0.5, ge=0, le=1, description="on_policy: share of batches the draft writes itself."
    )
    on_policy_tokens: int = Field(64, ge=1, description="on_policy: tokens written per prompt.")
    on_policy_temperature: float = Field(
        1.0, ge=0, description="on_policy: the draft's sampling temperature (0: greedy)."
    )
    parallel: int = Field(
        0,
        ge=0,
        le=16,
        description="K >= 2: the draft also learns to guess K tokens in one pass (PARD: K-1 mask "
        "tokens after the context); 0: off. sft only; not for models.draft=eagle3.",
    )
    parallel_keep: float = Field(
        1.0, gt=0, le=1, description="parallel: share of answer positions given a mask block."
    )
    mask_token: int | str | None = Field(
        None, description="parallel: the mask token (an id or a token); null: an unused id."
    )


class MergeConfig(Section):
    verify_prompts: int = Field(3, ge=1, description="Held-out prompts whose logits are compared.")
    atol: float = Field(1e-3, gt=0, description="Largest logit difference merged vs adapter.")


class PublishConfig(Section):
    target: Literal["local", "hub", "none"] = "local"
    registry: str | None = Field(None, description="Local registry; default <artifacts>/registry.")
    name: str = Field("phoenix-draft", description="Model name in the local registry.")
    repo_id: str | None = Field(None, description="Hub repo id (target: hub).")
    private: bool = True
    token_env: str = Field("HF_TOKEN", description="Env var with the Hub token.")
    dry_run: bool = Field(False, description="Show what would be pushed; push nothing.")
    retries: int = Field(3, ge=0)
    retry_wait_s: float = Field(1.0, gt=0, description="First retry wait; doubles, at most 30 s.")


class ObservabilityConfig(Section):
    enabled: bool = Field(True, description="Use Sentry when the DSN environment variable is set.")
    required: bool = Field(False, description="Refuse to start without a valid DSN.")
    dsn_env: str = Field("SENTRY_DSN", description="Env var holding the DSN (a secret).")
    environment: str = "development"
    release: str | None = Field(None, description="Default: phoenix@<package version>.")
    traces_sample_rate: float = Field(1.0, ge=0, le=1)
    profile_session_sample_rate: float = Field(1.0, ge=0, le=1, description="Continuous profiling.")
    shutdown_timeout_s: float = Field(2.0, ge=0, description="Longest wait to flush on exit.")


class RetrainConfig(Section):
    min_gain: float = Field(
        0.01,
        description="Promote only if acceptance beats the promoted (first run: base) draft's by "
        "this (absolute).",
    )
    gate_mode: str = Field("fixed_4", description="Bench mode whose acceptance the gate compares.")
    data: Literal["mbpp", "traffic"] = Field(
        "mbpp",
        description="mbpp: split + distill MBPP; traffic: the captured traffic since the promoted "
        "run, newest held out, training on from the promoted draft.",
    )
    traffic_test_size: int = Field(16, ge=1, description="traffic: newest N prompts held out.")
    traffic_min_records: int = Field(32, ge=1, description="traffic: fewer new: nothing to do.")


class TrafficConfig(Section):
    capture: bool = Field(
        False, description="Record served requests' token ids (never headers or keys) to train on."
    )
    folder: str | None = Field(None, description="Default <artifacts>/traffic.")
    max_file_mb: float = Field(64.0, gt=0, description="Rotate a file at this size.")
    max_files: int = Field(16, ge=1, description="Keep this many files; the oldest go.")
    pause_s: float = Field(60.0, gt=0, description="After a failed write (disk full): pause.")


class LockConfig(Section):
    """<artifacts>/phoenix.lock: one job per workspace."""

    heartbeat_s: float = Field(
        LOCK_HEARTBEAT_S, gt=0, description="How often the holder refreshes it."
    )
    stale_after_s: float = Field(
        LOCK_STALE_AFTER_S, gt=0, description="Another host's lock silent this long is taken over."
    )

    @model_validator(mode="after")
    def _stale_after_beats(self) -> LockConfig:
        if self.stale_after_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"lock.stale_after_s ({self.stale_after_s}) must exceed twice lock.heartbeat_s "
                f"({self.heartbeat_s}): a live holder would look stale"
            )
        return self


class Config(Section):
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    bandit: BanditConfig = Field(default_factory=BanditConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    merge: MergeConfig = Field(default_factory=MergeConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    retrain: RetrainConfig = Field(default_factory=RetrainConfig)
    traffic: TrafficConfig = Field(default_factory=TrafficConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    lock: LockConfig = Field(default_factory=LockConfig)

    def template_kwargs(self) -> dict[str, Any]:
        """Chat-template switches for every prompt Phoenix renders (Qwen3's enable_thinking)."""
        t = self.teacher.enable_thinking
        return {} if t is None else {"enable_thinking": t}

    def kd_source(self) -> str | None:
        """'target' (its weights), 'teacher' (stored top_logprobs), or None (sft); an EAGLE-3
        head's `auto` is the target."""
        t = self.train
        if t.objective == "sft":
            return None
        if t.objective == "on_policy":
            return "target"
        if t.kd_source != "auto":
            return t.kd_source
        if self.models.draft.strip() == "eagle3":
            return "target"
        return "teacher" if self.teacher.url != "local" and t.top_logprobs else "target"

    def requested_logprobs(self) -> int | None:
        """top_logprobs the distill stage asks the teacher for (None: none)."""
        return self.train.top_logprobs if self.kd_source() == "teacher" else None

    @model_validator(mode="after")
    def _eagle3_trainable(self) -> Config:
        if self.models.draft.strip() != "eagle3":
            return self
        if self.train.method == "lora":
            raise ValueError(
                "train.method=lora does not apply to models.draft=eagle3: the head (one layer, "
                "fc and its output head) is new and trained whole; set train.method=full"
            )
        t = self.train
        if t.objective == "on_policy":
            raise ValueError(
                "train.objective=on_policy is not built for models.draft=eagle3: the head "
                "learns the target's own greedy tokens (train.objective=sft) or its top-N "
                "distribution (train.objective=kd)"
            )
        if t.objective == "kd" and self.kd_source() == "teacher":
            raise ValueError(
                "train.objective=kd with models.draft=eagle3 learns from the target whose "
                "states the head reads (its top-20 next tokens, cached with them), not from "
                "the teacher endpoint: set train.kd_source=target"
            )
        if t.objective == "kd" and t.divergence != "forward_kl":
            raise ValueError(
                f"train.divergence={t.divergence} is not built for models.draft=eagle3: its kd "
                "is the cross-entropy on the target's top-N (forward_kl)"
            )
        return self

    @model_validator(mode="after")
    def _parallel_trainable(self) -> Config:
        k, t, why = self.train.parallel, self.train, None
        if k == 1:
            why = "adds no mask token (K counts the usual next token): set 0 (off) or 2..16"
        elif k and t.objective != "sft":
            why = f"trains with train.objective=sft only (the teacher's tokens), not {t.objective}"
        elif k and self.models.draft.strip() == "eagle3":
            why = "teaches a draft model mask blocks; models.draft=eagle3 is a head: set it to 0"
        if why:
            raise ValueError(f"train.parallel={k} {why}")
        return self

    def trains_head(self) -> bool:
        """models.head=distilled: train and merge build an EAGLE-3 head beside the draft."""
        return (self.models.head or "").strip() == HEAD_DISTILLED

    def head_config(self) -> Config:
        """The config that trains the head beside the draft: models.draft=eagle3, the head's
        epochs and learning rate, published as `<name>-eagle3`."""
        raw = self.model_dump()
        raw["models"].update(draft="eagle3", head=None)
        t = self.train
        raw["train"].update(
            method="full", objective="sft", epochs=t.head_epochs, learning_rate=t.head_learning_rate
        )
        raw["train"]["parallel"] = 0  # a head guesses through its own steps, not mask blocks
        p = self.publish
        raw["publish"].update(
            name=f"{p.name}-eagle3", repo_id=f"{p.repo_id}-eagle3" if p.repo_id else None
        )
        return Config.model_validate(raw)

    @model_validator(mode="after")
    def _head_beside_a_draft(self) -> Config:
        if self.trains_head() and self.models.draft.strip() == "eagle3":
            raise ValueError(
                "models.head=distilled trains a head beside the draft, but models.draft=eagle3 "
                "is a head already: set models.head=null, or models.draft to a model or cut:N"
            )
        return self

    @model_validator(mode="after")
    def _kd_reachable(self) -> Config:
        t = self.train
        if self.kd_source() != "teacher":
            return self
        if self.retrain.data == "traffic":
            raise ValueError(
                "retrain.data=traffic: captured answers carry no teacher logprobs, which "
                f"train.objective={t.objective} with a teacher source needs; use "
                "train.objective=sft or train.kd_source=target"
            )
        if t.top_logprobs is None:
            raise ValueError(
                f"train.objective={t.objective} with train.kd_source=teacher needs "
                "train.top_logprobs (N <= 20): a teacher endpoint only returns its top-N"
            )
        return self

    def resolved(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _set_path(raw: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"{origin}: bad key path {dotted!r}")
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value parsed as YAML, so `3` is an int and `null` is None)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    key, _, value = text.partition("=")
    try:
        return key.strip(), yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML: {exc}") from exc


def _format_validation(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid config in {origin}:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{key}'")
        elif not key:  # a rule across sections: the message names its keys
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  '{key}': {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config, apply `key.path=value` overrides, validate."""
    raw: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        raw = loaded
    for text in overrides or []:
        key, value = parse_override(text)
        _set_path(raw, key, value, f"--set {text}")
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        where = origin + (" (with --set overrides)" if overrides else "")
        raise ConfigError(_format_validation(exc, where)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.resolved(), sort_keys=False)
