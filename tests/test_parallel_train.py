"""Parallel draft training (train.parallel, PARD): the mask token, the rows, the 4-D mask
(what training shows equals what inference computes), the config's rules, train + merge."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pipeline import distillation, models, pard
from pipeline.config import load_config
from pipeline.errors import ConfigError
from tests.conftest import CI, copy_workspace, run_main

IGNORE = pard.IGNORE


def test_rows_hand_example_labels_anchors_depths_positions():
    # 3 prompt tokens, then answer tokens 13, 14, 15; K = 3: depths 1..2 after each anchor.
    row = {"input_ids": [10, 11, 12, 13, 14, 15], "completion_mask": [0, 0, 0, 1, 1, 1], "row": 7}
    assert pard.block_sizes(row["completion_mask"], 3) == [0, 0, 2, 1, 0, 0]
    out = pard.parallel_rows([row], k=3, keep=1.0, mask_id=99, seed=0)[0]
    assert out["input_ids"] == [10, 11, 12, 13, 14, 15, 99, 99, 99]
    assert out["anchor"] == [0, 1, 2, 3, 4, 5, 2, 2, 3]
    assert out["depth"] == [0, 0, 0, 0, 0, 0, 1, 2, 1]
    assert out["position_ids"] == [0, 1, 2, 3, 4, 5, 3, 4, 4]
    # Real tokens: the next answer token (the plain SFT labels); masks (2,1) (2,2) (3,1).
    assert out["targets"] == [IGNORE, IGNORE, 13, 14, 15, IGNORE, 14, 15, 15]
    assert out["row"] == 7
    # A block never crosses a non-answer token (a later turn's prompt): every mask has a label.
    turns = {"input_ids": list(range(8)), "completion_mask": [0, 1, 1, 0, 0, 1, 1, 1], "row": 0}
    assert pard.block_sizes(turns["completion_mask"], 4) == [1, 0, 0, 0, 2, 1, 0, 0]
    masks = pard.parallel_rows([turns], 4, 1.0, 99, 0)[0]
    assert IGNORE not in masks["targets"][8:]


def test_attention_rule_on_the_hand_example():
    anchor = torch.tensor([0, 1, 2, 3, 2, 2, 3])
    depth = torch.tensor([0, 0, 0, 0, 1, 2, 1])
    att = pard.block_attention(anchor, depth).int().tolist()
    assert att[:4] == [  # real tokens: causal, never a mask
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
    ]
    assert att[4] == [1, 1, 1, 0, 1, 0, 0]  # (2,1): real 0..2, itself
    assert att[5] == [1, 1, 1, 0, 1, 1, 0]  # (2,2): real 0..2, (2,1), itself
    assert att[6] == [1, 1, 1, 1, 0, 0, 1]  # (3,1): real 0..3, itself, not anchor 2's masks


def test_keep_share_is_seeded():
    rows = [
        {"input_ids": list(range(40)), "completion_mask": [0] * 5 + [1] * 35, "row": i}
        for i in range(3)
    ]
    a = pard.parallel_rows(rows, 4, 0.3, 99, seed=1)
    assert a == pard.parallel_rows(rows, 4, 0.3, 99, seed=1)
    assert a != pard.parallel_rows(rows, 4, 0.3, 99, seed=2)
    full = pard.parallel_rows(rows, 4, 1.0, 99, seed=1)
    blocks = {r["anchor"][i] for r in a[:1] for i in range(40, len(r["anchor"]))}
    assert len(blocks) == round(0.3 * 34)  # 34 anchors have a block (the last answer token none)
    assert all(len(x["input_ids"]) < len(y["input_ids"]) for x, y in zip(a, full, strict=True))


def _plain_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_training_forward_is_what_inference_sees(tiny_pair, attn):
    """The logits training takes at mask (t, j) are a plain forward's over [x_0..x_t, m x j] at
    its last position; at real tokens, a plain forward's over the real tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], attn_implementation=attn).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_pair[1], attn_implementation=attn).eval()
    distillation.add_compact_head(model)
    m, k = 250, 4
    rows = [
        {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "completion_mask": [0, 0, 1, 1, 1, 1, 1, 1]},
        {"input_ids": [20, 21, 22, 23, 24], "completion_mask": [0, 1, 1, 1, 1]},  # padded
    ]
    par = pard.parallel_rows([{**r, "row": i} for i, r in enumerate(rows)], k, 1.0, m, 0)
    b = distillation.Collator(pad_id=0)(par)
    assert b["attention_mask"].shape == (2, 1, len(par[0]["input_ids"]), len(par[0]["input_ids"]))
    with torch.no_grad():
        logits, labels, _ = pard.labelled_logits(
            model, b, pard.model_mask(b["attention_mask"], model)
        )
    at = b["targets"] != IGNORE
    where = at.nonzero().tolist()
    assert len(where) == len(logits)
    checked = {"real": 0, "mask": 0}
    for (i, p), got in zip(where, logits, strict=True):
        r = par[i]
        t, j = r["anchor"][p], r["depth"][p]
        ids = rows[i]["input_ids"][: t + 1] + [m] * j
        want = _plain_last_logits(plain, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        checked["mask" if j else "real"] += 1
    assert checked["mask"] >= 8 and checked["real"] >= 8
    loss, match, masks = distillation.parallel_loss(model, b, model)  # the trainer's loss
    assert loss.isfinite() and 0 <= match <= 1 and masks is not None


def _tok_and_config(vocab_extra: int = 0, spare: str | None = None):
    from pipeline.specs import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    if spare:
        tok.add_special_tokens({"additional_special_tokens": [spare]})
    return tok, SimpleNamespace(vocab_size=len(tok) + vocab_extra)


def test_parallel_token_auto_explicit_and_bad():
    tok, config = _tok_and_config(vocab_extra=5)
    assert models.parallel_token(tok, config) == len(tok)  # an unused embedding row
    tok, config = _tok_and_config(spare="<empty_output>")
    assert models.parallel_token(tok, config) == 259  # the spare special, not eos/bos/pad
    tok, config = _tok_and_config()
    with pytest.raises(ConfigError, match="no unused id"):  # every special is eos/bos/pad
        models.parallel_token(tok, config)
    assert models.parallel_token(tok, config, 42) == 42
    assert models.parallel_token(tok, config, "<|endoftext|>") == tok.pad_token_id
    for bad in (259, -1, "<nope>", True):
        with pytest.raises(ConfigError) as err:
            models.parallel_token(tok, config, bad)
        assert err.value.exit_code == 2


def test_config_rules():
    cfg = load_config(None, ["train.parallel=4", "train.mask_token=<pad>"])
    assert cfg.train.parallel == 4 and cfg.train.mask_token == "<pad>"
    assert load_config(None, ["train.mask_token=16"]).train.mask_token == 16
    bad = {
        "train.objective=kd": ["train.parallel", "train.objective"],
        "models.draft=eagle3": ["train.parallel", "models.draft"],
    }
    for extra, keys in bad.items():
        sets = ["train.parallel=4", extra, "train.method=full"]
        with pytest.raises(ConfigError) as err:
            load_config(None, sets)
        assert all(k in str(err.value) for k in keys)
    for bad_set in ("train.parallel=1", "train.parallel=17", "train.parallel_keep=0"):
        with pytest.raises(ConfigError):
            load_config(None, [bad_set])
    # The head trained beside the draft does not inherit the draft's mask blocks.
    cfg = load_config(None, ["train.parallel=4", "models.head=distilled"])
    assert cfg.head_config().train.parallel == 0


@pytest.mark.parametrize("method", ["lora", "full"])
def test_train_parallel_then_merge_keeps_pard_token(distilled_ws, tmp_path, method, cli):
    """LoRA's merge reloads the base (its config lacks the id: merge sets it from metrics.json);
    full weights carry it in their own config.json."""
    art = copy_workspace(distilled_ws, tmp_path / "art")
    sets = ["train.parallel=3", "train.max_steps=2", "train.batch_size=2", f"train.method={method}"]
    args = [x for s in sets for x in ("--set", s)]
    if method == "lora":  # the tiny tokenizer has no spare id: auto fails before training
        bad = cli("train", *CI, "--artifacts", art, *args)
        assert bad.returncode == 2 and "train.mask_token=None: no unused id" in bad.log
    assert run_main("train", *CI, "--artifacts", art, *args, "--set", "train.mask_token=3") == 0
    metrics = json.loads((art / "adapter" / "metrics.json").read_text())
    assert metrics["parallel"] == 3 and metrics["mask_token"] == 3
    assert metrics["parallel_match_last"] is not None
    if method == "full":
        trained = json.loads((art / "adapter" / "model" / "config.json").read_text())
        assert trained["pard_token"] == 3
    assert run_main("merge", *CI, "--artifacts", art) == 0
    merged = json.loads((art / "merged" / "config.json").read_text())
    assert merged["pard_token"] == 3
    card = (art / "merged" / "README.md").read_text()
    assert '"parallel_drafting": true' in card and '"num_speculative_tokens": 3' in card
