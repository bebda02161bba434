"""The config's sections for the pipeline's stages: the models, the data, the teacher, training,
merge, publishing, retraining, traffic capture, observability and the workspace lock.

Each class is one YAML section (`pipeline.config.Config` holds them all); its field names are
the YAML keys. Unknown keys are errors (`extra="forbid"`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .workspace import LOCK_HEARTBEAT_S, LOCK_STALE_AFTER_S


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelsConfig(Section):
    target: str = Field(
        "embedded:smollm2-135m-instruct",
        description="Hub id, local directory, `embedded:smollm2-135m-instruct`, or "
        "`tiny:key=value,...` (random test model).",
    )
    draft: str = Field(
        "cut:4",
        description="Same spec forms as target, or `cut:N` (the target's first N decoder "
        "layers) or `cut:0,2,4` (those layers), or `eagle3`: an EAGLE-3 head (one decoder layer "
        "over the target's hidden states from three depths, train.eagle3_layers) trained on the "
        "target's hidden states over the teacher's answers; needs the target's weights where "
        "train runs, exported in the speculators format vLLM serves.",
    )
    head: str | None = Field(
        None,
        description="An exported EAGLE-3 head (a merged directory of models.draft=eagle3) served "
        "beside the draft: the eagle:K arms. A server.draft or bench draft that is such a head "
        "is loaded as one too. `distilled`: the head this workspace trains beside the draft "
        "(train, merge: under <artifacts>/head/, train.head_epochs), benched beside it; serve "
        "then serves whichever of the two the bench measured faster.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on a GPU, float32 on the CPU."
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    served_name: str | None = Field(
        None, description="Model id the server lists; default: the target spec."
    )


class DataConfig(Section):
    source: str = Field(
        "../shared/data/mbpp.jsonl",
        description="MBPP JSONL path (relative paths: to the working directory), or a Hub "
        "dataset id. The environment variable PHOENIX_MBPP wins over this.",
    )
    hub_config: str = "full"
    seed: int = 42
    train_size: int = Field(500, ge=1)
    test_size: int = Field(50, ge=1)


class TeacherConfig(Section):
    url: str = Field("local", description="OpenAI-compatible base URL, or `local`.")
    model: str | None = Field(None, description="Model id to ask for; default: the target spec.")
    api_key_env: str = Field("PHOENIX_TEACHER_API_KEY", description="Env var with the API key.")
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="0: greedy answers; above: sampled, seeded by task_id (a rerun draws the same).",
    )
    enable_thinking: bool | None = Field(
        False, description="Sent as chat_template_kwargs.enable_thinking; null: not sent."
    )
    concurrency: int = Field(1, ge=1)
    return_token_ids: bool = Field(
        False,
        description="Ask a remote teacher for the answers' token ids (vLLM's return_token_ids), "
        "so the draft trains on the teacher's exact tokens; the local teacher always sends them.",
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
        description="Answers sampled from the target per prompt beside its main answer (at "
        "sample_temperature, seeded by task and sample), which train learns from too.",
    )
    sample_temperature: float = Field(
        0.6, gt=0, le=2, description="The extra samples' temperature."
    )


class TrainConfig(Section):
    method: Literal["lora", "full"] = Field(
        "lora",
        description="lora: a PEFT adapter; full: every weight (for drafts cut from the target).",
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
        description="sft: cross-entropy on the teacher's answers; kd: the target's next-token "
        "distribution on them; on_policy: the target's distribution on the draft's own "
        "continuations, mixed with the answers (train.on_policy_ratio).",
    )
    divergence: Literal["forward_kl", "reverse_kl", "tv", "jsd"] = Field(
        "forward_kl",
        description="kd/on_policy: KL(target||draft), KL(draft||target), total variation, or "
        "Jensen-Shannon (beta 0.5).",
    )
    kd_source: Literal["auto", "target", "teacher"] = Field(
        "auto",
        description="Where kd's distribution comes from. target: the target's weights, loaded "
        "beside the draft; teacher: the teacher endpoint's top_logprobs, which distill stores "
        "with each answer; auto: teacher when teacher.url is remote and top_logprobs is set, "
        "else target.",
    )
    top_logprobs: int | None = Field(
        None,
        ge=1,
        le=20,
        description="kd/on_policy: learn only the target's N most likely tokens per position "
        "(the rest as one bucket), as an OpenAI-compatible teacher returns them; null: the "
        "full distribution (needs the target's weights). models.draft=eagle3: the head's kd "
        "reads the target's top N of 20 cached with its states (null: 20).",
    )
    ttt_steps: int = Field(
        4,
        ge=1,
        le=8,
        description="models.draft=eagle3: training-time-test steps (the head fed its own "
        "outputs, so guesses 2..N are trained, not only the first; EAGLE-3).",
    )
    eagle3_layers: list[int] | None = Field(
        None,
        description="models.draft=eagle3: the three target layers whose inputs the head fuses "
        "(low, middle, high); null: 2, L/2, L-3, as vLLM chooses.",
    )
    head_epochs: float = Field(
        8.0,
        gt=0,
        description="models.head=distilled: epochs of the EAGLE-3 head trained beside the draft "
        "(method full, objective sft, train.ttt_steps, train.eagle3_layers).",
    )
    head_learning_rate: float = Field(
        1e-3, gt=0, description="models.head=distilled: the head's learning rate."
    )
    on_policy_ratio: float = Field(
        0.5, ge=0, le=1, description="on_policy: share of batches the draft writes itself."
    )
    on_policy_tokens: int = Field(
        64, ge=1, description="on_policy: tokens the draft writes per prompt."
    )
    on_policy_temperature: float = Field(
        1.0, ge=0, description="on_policy: the draft's sampling temperature (0: greedy)."
    )


class MergeConfig(Section):
    verify_prompts: int = Field(3, ge=1, description="Held-out prompts whose logits are compared.")
    atol: float = Field(
        1e-3, gt=0, description="Largest logit difference merged vs adapter allowed."
    )


class PublishConfig(Section):
    target: Literal["local", "hub", "none"] = "local"
    registry: str | None = Field(
        None, description="Local registry folder; default <artifacts>/registry."
    )
    name: str = Field("phoenix-draft", description="Model name in the local registry.")
    repo_id: str | None = Field(None, description="Hub repo id (target: hub).")
    private: bool = True
    token_env: str = Field("HF_TOKEN", description="Env var with the Hub token.")
    dry_run: bool = Field(False, description="Show what would be pushed; push nothing.")
    retries: int = Field(3, ge=0)
    retry_wait_s: float = Field(
        1.0, gt=0, description="Wait before the first retry of a push; doubles, at most 30 s."
    )


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
        description="Promote only if held-out acceptance beats the promoted draft's (first run: "
        "the base draft's) by at least this much (absolute, 0.01 = one point).",
    )
    gate_mode: str = Field("fixed_4", description="Bench mode whose acceptance the gate compares.")
    data: Literal["mbpp", "traffic"] = Field(
        "mbpp",
        description="mbpp: split + distill the MBPP prompts; traffic: the server's captured "
        "traffic since the promoted run (no teacher calls), its newest records held out as the "
        "gate's test set, training continued from the promoted draft.",
    )
    traffic_test_size: int = Field(
        16, ge=1, description="traffic: the newest N distinct prompts: the gate's held-out slice."
    )
    traffic_min_records: int = Field(
        32, ge=1, description="traffic: fewer new trainable records than this: nothing to do."
    )


class TrafficConfig(Section):
    capture: bool = Field(
        False,
        description="Record served requests (token ids, mode, acceptance; never headers or "
        "keys) as training data for retrain.data=traffic.",
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
        LOCK_STALE_AFTER_S,
        gt=0,
        description="A lock from another host not refreshed for this long is taken over (its "
        "holder, a pod evicted mid-run, is gone).",
    )

    @model_validator(mode="after")
    def _stale_after_beats(self) -> LockConfig:
        if self.stale_after_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"lock.stale_after_s ({self.stale_after_s}) must exceed twice lock.heartbeat_s "
                f"({self.heartbeat_s}): a live holder would look stale"
            )
        return self
