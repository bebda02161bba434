"""Typed configuration: YAML files whose keys are exactly these field names.

`Config` holds one section per YAML mapping (the sections: `config_stages.py`, the pipeline's
stages, and `config_serving.py`, serving and its measurement), the rules that span sections,
and here too: loading a file, `--set key.path=value` overrides, and validation messages.
Unknown keys and wrong types are errors that name the key and the file. Secrets never live
here: fields ending in `_env` name the environment variable that holds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from .config_serving import BanditConfig, BenchConfig, EngineConfig, ServerConfig, VllmConfig
from .config_stages import (
    DataConfig,
    DistillConfig,
    LockConfig,
    MergeConfig,
    ModelsConfig,
    ObservabilityConfig,
    PublishConfig,
    RetrainConfig,
    Section,
    TeacherConfig,
    TrafficConfig,
    TrainConfig,
)
from .errors import ConfigError

HEAD_DISTILLED = "distilled"  # models.head: the head this workspace trains beside the draft


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
        """Where the target's distribution comes from: 'target' (its weights, loaded beside the
        draft), 'teacher' (the top_logprobs distill stores with each answer), or None (sft
        learns from the answers' tokens alone). An EAGLE-3 head reads the target's states, so
        its kd's `auto` is the target."""
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

    def trains_head(self) -> bool:
        """models.head=distilled: train and merge build an EAGLE-3 head beside the draft."""
        return (self.models.head or "").strip() == HEAD_DISTILLED

    def head_config(self) -> Config:
        """The config that trains and merges the head beside the draft (models.head=distilled):
        models.draft=eagle3 with the head's epochs and learning rate, published under its own
        registry name (and Hub repo) beside the draft's."""
        raw = self.model_dump()
        raw["models"].update(draft="eagle3", head=None)
        t = self.train
        raw["train"].update(
            method="full", objective="sft", epochs=t.head_epochs, learning_rate=t.head_learning_rate
        )
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
