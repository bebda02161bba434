"""Phoenix's exported EAGLE-3 head against the reference implementation (vllm-project/speculators
0.9.0, `Eagle3DraftModel`) on the same inputs: do both read the exported directory the same way
and compute the same draft logits? A check, not a test (it needs a second venv).

    # once: a venv with speculators (it pins transformers <= 5.19, Phoenix's has a newer one)
    python3 -m venv /tmp/spec-check/venv
    /tmp/spec-check/venv/bin/pip install torch==2.13.0 'transformers>=5.16.1,<=5.19.0' \
        safetensors openai 'datasets>=4,<=5.1' pydantic pydantic-settings loguru httpx \
        aiohttp protobuf psutil typer rich click
    /tmp/spec-check/venv/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0

    # both halves: Phoenix's here, then the reference in the speculators venv
    .venv/bin/python -m benchmarks.speculators_parity \
        --head artifacts/full500/perf/eagle3/eagle3-500x4/head \
        --reference-python /tmp/spec-check/venv/bin/python
    # or each half alone: --phoenix (writes --out), --reference (reads it; the speculators venv)

Phoenix's half (its venv): the target (the head's verifier resolved as `pipeline.models` does, or
--target) reads three short code snippets in float32; its hidden states at the head's aux layers
(`output_hidden_states[L]`, ascending, concatenated) and the head's logits at every position,
teacher-forced as vLLM's first draft step is (ids = seq[1:], hidden = fuse(aux[:-1]),
positions 0..), plus its training-time-test logits (`ttt_logits`, --ttt steps) go to --out.

The reference half (the speculators venv, importing nothing of Phoenix's): the exported config
read by `Eagle3SpeculatorConfig.from_pretrained`, the model built by hand (`from_pretrained`
needs the verifier reachable by name: tried too, and reported) with eager attention, the
exported safetensors loaded into it (`embed_tokens` from the target's weights where an older
export has none). Its forward on the same inputs (document ids 0, position
ids those Phoenix used) gives its draft ids per TTT step; the logits come from a hook on its
`lm_head`. Compared per step: argmax agreement (positions whose top two logits lie within --tol
of each other count as ties) and the largest logit difference. Step j is compared at the
positions whose teacher-forced token exists (t < T - 1 - j): both pad differently past it.
Exit status 1 if any argmax differs (ties aside) or a logit differs by more than --tol.

Reported beside the verdict, not in it: `Eagle3DraftModel.from_pretrained` (the reference's own
loader, its default flex attention) on the directory as exported, with the verifier pointed at
the target's directory, and with the target's `embed_tokens.weight` added too, each with its
first-step agreement: what a speculators user gets from the directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

SNIPPETS = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\nprint(fibonacci(10))\n",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n        data = json.load(f)\n"
    "    return {k: v for k, v in data.items() if v is not None}\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
]


# -- Phoenix's half ------------------------------------------------------------------------------


def target_of(verifier: str) -> str:
    """The verifier's local weights: a directory as named, an embedded target by its Hub id."""
    from pipeline import specs

    cache = ROOT / "artifacts" / "cache" / "models"
    if Path(verifier).is_dir():
        return verifier
    for name, hub in specs.EMBEDDED_HUB_IDS.items():
        if hub == verifier:
            return specs.resolve(f"embedded:{name}", cache)
    return specs.resolve(verifier, cache)


@torch.no_grad()
def phoenix(head_dir: Path, target_dir: str | None, out: Path, ttt: int) -> None:
    from pipeline import eagle3, models
    from pipeline.speculative.eagle3 import HeadCache

    config = json.loads((head_dir / eagle3.CONFIG_NAME).read_text())
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    target_ref = target_dir or target_of(verifier)
    target = models.load_model(target_ref, "float32", "cpu")
    tok = models.load_tokenizer(target_ref)
    head = eagle3.load_head(head_dir, target).float()
    aux_ids = head.config.aux_layer_ids
    rows = []
    for text in SNIPPETS:
        seq = models.text_prompt_ids(tok, text)
        o = target(input_ids=torch.tensor([seq]), output_hidden_states=True)
        aux = torch.cat([o.hidden_states[a] for a in aux_ids], dim=-1)[0]  # [T, 3H]
        logits, _ = head.forward_step(
            torch.tensor([seq[1:]]), head.fuse(aux[:-1])[None], 0, HeadCache()
        )
        steps = head.ttt_logits(torch.tensor([seq]), aux[None], ttt)
        rows.append(
            {
                "ids": torch.tensor(seq),
                "aux": aux.contiguous(),
                "logits": logits[0].contiguous(),  # [T-1, V_d]
                "argmax": logits[0].argmax(-1),
                "ttt": [s[0, :-1].contiguous() for s in steps],  # [T-1, V_d] per step
            }
        )
    torch.save(
        {
            "head": str(head_dir.resolve()),
            "target": str(Path(target_ref).resolve()),
            "aux_layer_ids": list(aux_ids),
            "target_ids": head.target_ids.clone(),
            "rows": rows,
        },
        out,
    )
    n = sum(len(r["ids"]) for r in rows)
    print(
        f"phoenix: {len(rows)} sequences, {n} tokens, aux layers {list(aux_ids)}, "
        f"draft vocab {head.config.draft_vocab_size}, target {target_ref} -> {out}"
    )


# -- the reference half (speculators' venv) ------------------------------------------------------


def compare(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    """Argmax agreement and max |logit difference| of two [N, V] logit tensors."""
    a, b = ours.argmax(-1), ref.argmax(-1)
    differ = (a != b).nonzero().flatten().tolist()
    ties = 0
    for i in differ:
        pair = torch.tensor([int(a[i]), int(b[i])])
        if float(ours[i, pair].diff().abs()) <= tol and float(ref[i, pair].diff().abs()) <= tol:
            ties += 1
    return {
        "n": len(a),
        "agree": len(a) - len(differ),
        "ties": ties,
        "max_abs": float((ours - ref).abs().max()),
    }


def run_reference(model, row: dict, steps: int, positions: bool = True) -> list[torch.Tensor]:
    """The reference's forward on one sequence, teacher-forced as Phoenix's was: its logits
    [T-1, V_d] per TTT step, read off `lm_head` (its forward returns only the argmax ids)."""
    got: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: got.append(o[0].float()))
    t = len(row["ids"]) - 1
    extra = {"position_ids": torch.arange(t)[None]} if positions else {}  # else its 1..T
    try:
        drafts = model(
            row["aux"][:-1][None].float(),
            row["ids"][1:][None],
            torch.zeros(1, t, dtype=torch.long),  # document ids: one document
            ttt_steps=steps,
            **extra,
        )
    finally:
        hook.remove()
    for d, g in zip(drafts, got, strict=True):
        assert torch.equal(d[0], g.argmax(-1))
    return got


def loader_checks(data: dict, tol: float) -> list[str]:
    """`Eagle3DraftModel.from_pretrained`, the reference's own loader (default attention), on
    the directory as exported, then on copies with the verifier pointed at the target's
    directory and also with the target's `embed_tokens.weight` added: whether it loads and
    what its first draft step then gives. Reported, not part of the verdict."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from speculators.models.eagle3 import Eagle3DraftModel

    head_dir, target_dir = Path(data["head"]), data["target"]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("as exported", head_dir)]
        for name, embed in (("verifier = target dir", False), ("+ embed_tokens", True)):
            copy = Path(tmp) / name.replace(" ", "_")
            shutil.copytree(head_dir, copy)
            cfg = json.loads((copy / "config.json").read_text())
            cfg["speculators_config"]["verifier"]["name_or_path"] = target_dir
            (copy / "config.json").write_text(json.dumps(cfg))
            if embed:
                state = load_file(str(copy / "model.safetensors"))
                state["embed_tokens.weight"] = target_embedding(target_dir)
                save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
            variants.append((name, copy))
        for name, folder in variants:
            try:
                model = Eagle3DraftModel.from_pretrained(str(folder)).float().eval()
            except Exception as e:  # noqa: BLE001 - reported, not handled
                lines.append(f"from_pretrained({name}): {type(e).__name__}: {str(e)[:140]}")
                continue
            same = torch.equal(model.embed_tokens.weight, target_embedding(target_dir))
            n = agree = 0
            worst = 0.0
            for r in data["rows"]:
                s = compare(r["logits"], run_reference(model, r, 1)[0], tol)
                n, agree, worst = n + s["n"], agree + s["agree"], max(worst, s["max_abs"])
            lines.append(
                f"from_pretrained({name}): loads ({model._attn_impl}); embed_tokens equal to "
                f"the target's: {same}; first step argmax {agree}/{n}, max |logit diff| {worst:.2e}"
            )
    return lines


def target_embedding(target_dir: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


@torch.no_grad()
def reference(out: Path, tol: float, attn: str) -> int:
    import warnings

    from loguru import logger
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from transformers.utils import logging as hf_logging

    logger.disable("speculators")
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    data = torch.load(out, weights_only=True)
    head_dir, target_dir = Path(data["head"]), data["target"]
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(head_dir))
    cfg.transformer_layer_config._attn_implementation = attn
    model = Eagle3DraftModel(cfg).float().eval()
    state = load_file(str(head_dir / "model.safetensors"))
    exported_embed = "embed_tokens.weight" in state
    state.setdefault("embed_tokens.weight", target_embedding(target_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    print(f"reference: speculators Eagle3DraftModel built from {head_dir}, attention {attn}")
    print(f"  embed_tokens: {'exported' if exported_embed else 'from the target'}; "
          f"keys not in the export: {sorted(missing)}")  # fmt: skip
    print(f"  keys it does not know: {sorted(unexpected) or 'none'}")
    ok = not (set(missing) - {"verifier_lm_head.weight", "verifier_norm.weight"} | set(unexpected))
    ids = torch.arange(model.draft_vocab_size) + (model.d2t if model.d2t is not None else 0)
    same_vocab = torch.equal(ids, data["target_ids"])
    t2d_ok = model.t2d is None or torch.equal(model.t2d.nonzero().flatten(), ids)
    print(
        f"  draft->target ids equal to Phoenix's: {same_vocab}; t2d consistent with d2t: {t2d_ok}"
    )
    ok = ok and same_vocab and t2d_ok
    steps = len(data["rows"][0]["ttt"])
    totals = [{"n": 0, "agree": 0, "ties": 0, "max_abs": 0.0} for _ in range(steps)]
    shift = 0.0
    for r in data["rows"]:
        t = len(r["ids"]) - 1
        got = run_reference(model, r, steps)
        one = compare(r["logits"], got[0], tol)
        for j in range(steps):
            s = compare(r["ttt"][j][: t - j], got[j][: t - j], tol)
            for k in ("n", "agree", "ties"):
                totals[j][k] += s[k]
            totals[j]["max_abs"] = max(totals[j]["max_abs"], s["max_abs"])
        own = run_reference(model, r, 1, positions=False)[0]
        shift = max(shift, float((own - r["logits"]).abs().max()))
        print(
            f"  sequence of {t + 1} tokens, first draft step (forward_step): argmax "
            f"{one['agree']}/{one['n']} (+{one['ties']} ties), max |logit diff| {one['max_abs']:.2e}"
        )
        ok = ok and one["agree"] + one["ties"] == one["n"] and one["max_abs"] <= tol
    for j, s in enumerate(totals):
        print(
            f"  TTT step {j} (ttt_logits, teacher-forced): argmax {s['agree']}/{s['n']} "
            f"(+{s['ties']} ties), max |logit diff| {s['max_abs']:.2e}"
        )
        ok = ok and s["agree"] + s["ties"] == s["n"] and s["max_abs"] <= tol
    print(f"  first step at speculators' default positions (1..T): max |logit diff| {shift:.2e}")
    print("loader (not in the verdict):")
    for line in loader_checks(data, tol):
        print(f"  {line}")
    print(f"{'PASS' if ok else 'FAIL'} (logit tolerance {tol:g}, float32)")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=Path, help="an exported head directory (Phoenix's half)")
    ap.add_argument("--target", help="the target's directory (default: the head's verifier)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/speculators_parity.pt"))
    ap.add_argument("--phoenix", action="store_true", help="only Phoenix's half")
    ap.add_argument("--reference", action="store_true", help="only the reference half")
    ap.add_argument("--reference-python", help="the speculators venv's python (both halves)")
    ap.add_argument("--ttt", type=int, default=3, help="training-time-test steps compared")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    a = ap.parse_args()
    if a.reference:
        return reference(a.out, a.tol, a.attn)
    if a.head is None:
        ap.error("--head is needed for Phoenix's half")
    if not a.phoenix and not a.reference_python:
        ap.error("both halves need --reference-python (or pass --phoenix / --reference)")
    phoenix(a.head, a.target, a.out, a.ttt)
    if a.phoenix:
        return 0
    cmd = [a.reference_python, "-m", "benchmarks.speculators_parity", "--reference"]
    cmd += ["--out", str(a.out), "--tol", str(a.tol), "--attn", a.attn]
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
