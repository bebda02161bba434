import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.distillation import build_examples
from tests.conftest import CI, copy_workspace, run_main
from tests.fake_hub import FakeHub

TRAIN_SETTINGS = (
    "train.method=lora",
    "train.max_steps=8",
    "train.save_steps=2",
    "train.batch_size=2",
    "train.learning_rate=0.01",
)
TRAIN = [x for s in TRAIN_SETTINGS for x in ("--set", s)]


@pytest.fixture(scope="module")
def lora_ws(distilled_ws, tmp_path_factory):
    """The session's distilled workspace after `train` with 8 LoRA steps (TRAIN), trained once
    through the command line's `main()` (as a real process: the DDP test in test-slow)."""
    art = copy_workspace(distilled_ws, tmp_path_factory.mktemp("lora") / "art")
    assert run_main("train", *CI, "--artifacts", art, *TRAIN) == 0
    assert (art / "adapter" / "config.yaml").is_file()  # the resolved config, beside the outputs
    return art


def test_examples_mask_the_prompt_and_keep_teacher_tokens():
    from pipeline.specs import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    answers = [
        {
            "prompt": "p1",
            "completion": "ignored",
            "completion_token_ids": [5, 6, 7],
            "finish_reason": "stop",
        },
        {"prompt": "p2", "completion": "abc", "finish_reason": "length"},
    ]
    rows, sparse = build_examples(answers, tok, {}, 512)
    # vLLM's token_ids carry the end-of-turn already: it is not learnt twice.
    vllm_style = [{**answers[0], "completion_token_ids": [5, 6, 7, tok.eos_token_id]}]
    assert build_examples(vllm_style, tok, {}, 512)[0][0]["input_ids"] == rows[0]["input_ids"]
    assert sparse == {}  # no stored logprobs asked for
    first, second = rows
    n = sum(first["completion_mask"])
    assert first["input_ids"][-n:] == [
        5,
        6,
        7,
        tok.eos_token_id,
    ]  # ids as the teacher made them, + end of turn
    assert second["input_ids"][-3:] == tok("abc", add_special_tokens=False)["input_ids"]
    assert tok.eos_token_id not in second["input_ids"][-3:]  # cut at max_tokens: no end-of-turn
    assert first["completion_mask"][: len(first["input_ids"]) - n] == [0] * (
        len(first["input_ids"]) - n
    )


def test_lora_moves_adapter_not_base_then_merge_equals_base_plus_adapter(lora_ws, tmp_path, cli):
    art = copy_workspace(lora_ws, tmp_path / "art")
    metrics = json.loads((art / "adapter" / "metrics.json").read_text())
    assert metrics["method"] == "lora" and metrics["global_steps"] == 8
    log = [json.loads(x) for x in (art / "adapter" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 8 and all("loss" in h for h in log)
    base_file = metrics["base_draft"] + "/model.safetensors"
    base = load_file(base_file)
    adapter = load_file(str(art / "adapter" / "model" / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # B starts at zero: it moved
    # The base draft on disk is untouched (training never writes it).
    assert all(torch.equal(v, load_file(base_file)[k]) for k, v in base.items())

    r = cli("merge", *CI, "--artifacts", art)
    assert r.returncode == 0, r.log
    merged = load_file(str(art / "merged" / "model.safetensors"))
    # W_merged = W_base + (alpha / r) * B @ A, for every adapted layer.
    cfg = json.loads((art / "adapter" / "model" / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    checked = 0
    for key, a in adapter.items():
        if "lora_A" not in key:
            continue
        b = adapter[key.replace("lora_A", "lora_B")]
        name = key.split("base_model.model.")[1].replace(".lora_A.weight", ".weight")
        expected = base[name] + scale * b @ a
        assert torch.allclose(merged[name], expected, atol=1e-5), name
        assert not torch.equal(merged[name], base[name])
        checked += 1
    assert checked > 0
    assert not (art / "merged" / "adapter_config.json").exists()
    card = (art / "merged" / "README.md").read_text()
    assert card.startswith("---") and "lora" in card and "sha256" in card
    # Published to the local registry as an immutable version.
    latest = json.loads((art / "registry" / "phoenix-draft" / "latest.json").read_text())
    version = art / "registry" / "phoenix-draft" / latest["version"]
    assert (version / "model.safetensors").read_bytes() == (
        art / "merged" / "model.safetensors"
    ).read_bytes()
    # The merged directory loads with plain transformers (no PEFT).
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(art / "merged"))
    # Merging again with the same content registers nothing new.
    r = cli("merge", *CI, "--artifacts", art)
    assert r.returncode == 0 and "already registered" in r.log
    assert len(list((art / "registry" / "phoenix-draft").glob("v*"))) == 1


def test_finished_training_is_not_repeated_unless_forced(lora_ws, tmp_path, cli):
    art = copy_workspace(lora_ws, tmp_path / "art")
    r = cli("train", *CI, "--artifacts", art, *TRAIN)
    assert r.returncode == 0 and "already finished" in r.log
    r = cli("train", *CI, "--artifacts", art, *TRAIN, "--force")
    assert r.returncode == 0 and "starting over" in r.log


def test_resume_after_interruption_continues_from_checkpoint(lora_ws, tmp_path, cli):
    art = copy_workspace(lora_ws, tmp_path / "art")
    # Leave the workspace as a crash after step 6 would: checkpoints up to 6, no final outputs,
    # and a checkpoint-8 cut short (no trainer_state.json, written last).
    adapter = art / "adapter"
    (adapter / "checkpoints" / "checkpoint-8" / "trainer_state.json").unlink()
    shutil.rmtree(adapter / "model")
    (adapter / "metrics.json").unlink()
    r = cli("train", *CI, "--artifacts", art, *TRAIN)
    assert r.returncode == 0, r.log
    assert "incomplete checkpoint" in r.log and "resuming from" in r.log and "checkpoint-6" in r.log
    metrics = json.loads((adapter / "metrics.json").read_text())
    assert metrics["global_steps"] == 8 and metrics["resumed_from"].endswith("checkpoint-6")
    a = load_file(str(adapter / "model" / "adapter_model.safetensors"))
    b = load_file(str(lora_ws / "adapter" / "model" / "adapter_model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # same result as never stopping


def test_full_finetune_then_merge_verifies_and_publishes(merged_ws):
    """The session's merged workspace: configs/ci.yaml trains every weight."""
    art = merged_ws
    metrics = json.loads((art / "adapter" / "metrics.json").read_text())
    assert metrics["method"] == "full"
    assert metrics["trainable_parameters"] == metrics["total_parameters"]
    base = load_file(metrics["base_draft"] + "/model.safetensors")
    trained = load_file(str(art / "adapter" / "model" / "model.safetensors"))
    assert any(not torch.equal(trained[k], base[k]) for k in base if k in trained)
    merged = load_file(str(art / "merged" / "model.safetensors"))
    assert all(torch.equal(merged[k], trained[k]) for k in trained)
    published = json.loads((art / "merged" / "publish.json").read_text())["published"]
    assert (Path(published["path"]) / "model.safetensors").is_file()
    # The train stage counted the answers' tokens; they travel with the draft (draft_vocab).
    counts = json.loads((art / "merged" / "token_counts.json").read_text())
    assert counts["tokens"] == metrics["completion_tokens"] == sum(n for _, n in counts["counts"])
    assert [n for _, n in counts["counts"]] == sorted(
        (n for _, n in counts["counts"]), reverse=True
    )
    assert (Path(published["path"]) / "token_counts.json").is_file()


def test_failed_verification_publishes_nothing(lora_ws, tmp_path, cli):
    art = copy_workspace(lora_ws, tmp_path / "art")
    r = cli("merge", *CI, "--artifacts", art, "--set", "merge.atol=1e-12")
    assert r.returncode == 4 and "differs" in r.log
    assert not (art / "merged").exists() and not (art / "registry").exists()
    assert not list(art.glob(".merged.*"))


def test_merge_without_training_is_a_clear_error(tmp_path, cli):
    r = cli("merge", *CI, "--artifacts", tmp_path)
    assert r.returncode == 2 and "run the train stage first" in r.log


def test_dry_run_pushes_nothing(lora_ws, tmp_path, cli):
    art = copy_workspace(lora_ws, tmp_path / "art")
    r = cli("merge", *CI, "--artifacts", art, "--set", "publish.dry_run=true")
    assert r.returncode == 0 and "would push" in r.log and "model.safetensors" in r.log
    assert not (art / "registry").exists()


def test_hub_push_to_a_local_hub_server(lora_ws, tmp_path, cli, monkeypatch):
    """A push to a local Hub stand-in that fails once with a 500 and once with a dropped
    connection (merge as a real process: `python -m pipeline demo` in test-slow)."""
    art = copy_workspace(lora_ws, tmp_path / "art")
    cfg = yaml.safe_load(open("configs/ci.yaml"))
    cfg["publish"] = {
        "target": "hub",
        "repo_id": "phoenix/tiny-draft",
        "retries": 2,
        "retry_wait_s": 0.05,
    }
    cfg_file = tmp_path / "hub.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    with FakeHub(token="hf_secret_value", fail_commits=1, drop_commits=1) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        # HF_HUB_DISABLE_XET=1, as this process would have read it at import: the stand-in
        # speaks the plain (LFS) upload API only.
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        r = cli("merge", "--config", cfg_file, "--artifacts", art)
        assert r.returncode == 0, r.log
        repo = hub.repos["phoenix/tiny-draft"]
        assert repo["private"] is True and len(repo["commits"]) == 1  # the 500 and drop retried
        assert r.log.count("Hub push failed; retry") == 2
        assert "Phoenix draft, run" in repo["commits"][0]["summary"]
        local = {p.name: p.read_bytes() for p in (art / "merged").iterdir()}
        del local["publish.json"]  # written after the push: where it went
        assert repo["files"] == local  # the complete model, byte for byte
        assert hub.card_metadata["tags"][0] == "phoenix"
        assert "hf_secret_value" not in r.log
        assert "hf_secret_value" not in (art / "merged" / "publish.json").read_text()
        # A wrong token fails clearly, without retry storms, and without printing the token.
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        r = cli("merge", "--config", cfg_file, "--artifacts", art)
        assert r.returncode != 0 and "refused the token" in r.log and "hf_wrong" not in r.log
    monkeypatch.setenv("HF_TOKEN", "")
    r = cli("merge", "--config", cfg_file, "--artifacts", art)
    assert r.returncode == 2 and "HF_TOKEN" in r.log


@pytest.mark.slow
def test_distributed_training_with_two_cpu_processes(distilled_ws, tmp_path):
    """The DDP code path (gloo), as `accelerate launch` drives it on GPUs, with torchrun on 2 CPUs."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    art = copy_workspace(distilled_ws, tmp_path / "art")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "pipeline",
            "train",
            "--config",
            "configs/ci.yaml",
            "--artifacts",
            str(art),
            *TRAIN,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((art / "adapter" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_steps"] == 8
    assert (art / "adapter" / "model" / "adapter_model.safetensors").is_file()


def test_merge_saves_and_verifies_in_the_configured_dtype(merged_ws, tmp_path, cli):
    """bf16 (Qwen3's dtype): the weights are saved in it, and the check compares the fp32
    reference with them, not a model with itself: a tolerance below bf16's rounding fails."""
    art = copy_workspace(merged_ws, tmp_path / "art")
    shutil.rmtree(art / "merged")
    bf16 = ["--set", "models.dtype=bfloat16", "--set", "publish.target=none"]
    r = cli("merge", *CI, "--artifacts", art, *bf16, "--set", "merge.atol=1e-7")
    assert r.returncode == 4 and "differs" in r.log and not (art / "merged").exists()
    r = cli("merge", *CI, "--artifacts", art, *bf16, "--set", "merge.atol=0.5")
    assert r.returncode == 0, r.log
    weights = load_file(str(art / "merged" / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
