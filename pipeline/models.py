"""The one loader (`load_pair`: target, draft, EAGLE-3 head, in the dtype this machine runs
fastest) and the one prompt path (a chat through the tokenizer's template, then ids)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .artifacts import is_verified
from .config import HEAD_DISTILLED
from .errors import ConfigError
from .specs import hub_id_of, resolve
from .workspace import atomic_write_json

log = logging.getLogger(__name__)


def chat_prompt_ids(tok, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The ids a model sees for a conversation, generation prompt included (server, bench,
    training alike)."""
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


def pick_device(device: str) -> str:
    import torch

    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(dtype: str, device: str):
    """A dtype setting as torch's: auto is bfloat16 on a GPU, else float32 (see `run_dtype`)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    import platform

    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_dtype(ws, target_ref: str) -> str:
    """`models.dtype: auto` on a CPU: bfloat16 where a probe of the target's matmuls
    (`speculative.cpu.probe_dtypes`) finds it faster than float32, else float32; probed once per
    CPU, torch and target (<cache>/cpu-probe.json)."""
    import json

    import torch

    from .speculative.cpu import probe_dtypes

    cpu = cpu_name()
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
    """A loaded target (+ draft, + head) with its tokenizer and where they came from."""

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
    """Write the rows' completion token counts, most frequent first, to `path`, plus those of
    the draft directory `start_from` (training continued from it keeps its vocabulary)."""
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
    roughly from frequent to rare)."""
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
    """The token counts beside the draft, else beside this workspace's merged draft (the base
    draft shares its tokenizer); ConfigError naming `engine.draft_vocab` when neither has them."""
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
    """The draft head's `n` ids (default `engine.draft_vocab`; 0: None, the full head)."""
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
    """Target, draft, head and tokenizer per config. `draft`: a spec, None (target only) or SELF;
    `share_target`: reuse that pair's target and tokenizer; `head_dir`: the EAGLE-3 head beside
    a draft model (default `head_ref`; None: none); `full_head`: ignore `engine.draft_vocab`.
    On a CPU the linear layers take the matmul form it runs fastest (`speculative.cpu`)."""
    from .speculative.cpu import choose_linears, use_linears
    from .speculative.loaded import Models

    m = cfg.models
    device = pick_device(m.device)
    head = None
    if share_target is not None:
        s = share_target
        target_ref, tok, target = s.target_ref, s.tokenizer, s.target
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
    try:
        loaded = Models(target, draft_model, eos, tok.pad_token_id, subset, head)
    except ValueError as exc:  # a draft or head that does not fit the target: its files' fault
        raise ConfigError(f"{draft_ref}: {exc}") from None
    return Pair(tok, loaded, target_ref, draft_ref)


def load_target_for_head(cfg, ws):
    """(directory, tokenizer, float32 frozen target) for a head's training or check;
    ConfigError naming models.draft when the weights cannot be loaded."""
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
    """A head's `verifier.name_or_path`: the target's Hub id where it has one, else its
    directory; a head is served only beside the target it names."""
    return hub_id_of(cfg.models.target) or str(target_ref)


def head_ref(cfg, ws) -> str | None:
    """models.head as a directory, or None (`distilled`: <artifacts>/head/merged, ConfigError
    when not built yet)."""
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
    """An exported EAGLE-3 head over the loaded target; ConfigError if made for another."""
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


def parallel_token(tok, config, wanted: int | str | None = None) -> int:
    """The mask id a parallel draft (PARD) fills its guessed block with. `wanted` None (auto):
    id len(tok) where the embedding has rows past the tokenizer (an unused row, e.g. Qwen3's
    padding), else the highest-id added special token that is not eos/bos/pad/unk and whose
    text the chat template never writes (SmolLM2: `<empty_output>`). An int: that id; a string:
    that token's id. ConfigError (exit 2) for an id outside [0, config.vocab_size), an unknown
    token, or no free id."""
    vocab = int(config.vocab_size)
    if wanted is None:
        if vocab > len(tok):
            return len(tok)
        reserved = {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.unk_token_id}
        template = (
            tok.chat_template
            if isinstance(tok.chat_template, str)
            else str(tok.chat_template or "")
        )
        free = [
            i
            for i, t in tok.added_tokens_decoder.items()
            if t.special and i not in reserved and i < vocab and t.content not in template
        ]
        if not free:
            raise ConfigError(
                f"no unused id for the mask token: the draft's embedding has {vocab} rows, all "
                "its tokenizer's, and no spare special token; name one (an id or a token "
                "string that the training data never uses) as the mask token"
            )
        return max(free)
    if isinstance(wanted, str):
        found = tok.get_vocab().get(wanted)
        if found is None:
            raise ConfigError(f"mask token {wanted!r} is not a token of the draft's vocabulary")
        wanted = found
    if isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 <= wanted < vocab:
        raise ConfigError(
            f"mask token id {wanted!r} is outside the draft's vocabulary [0, {vocab})"
        )
    return wanted
