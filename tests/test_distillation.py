"""Issue 17: the train stage's objectives (sft, kd dense/sparse, on_policy), their losses, and the
teacher logprobs that sparse kd learns from (a real local OpenAI-compatible server)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml

from pipeline import distillation, models, specs
from pipeline.config import load_config
from pipeline.errors import ConfigError
from tests.conftest import CI, MBPP, build_workspace, copy_workspace
from tests.fake_openai import FakeOpenAI


# --- losses ------------------------------------------------------------------------------------
def test_divergences_vanish_at_equality_and_match_their_definitions():
    g = torch.Generator().manual_seed(0)
    t = F.log_softmax(torch.randn(5, 11, generator=g), -1)
    s = F.log_softmax(torch.randn(5, 11, generator=g), -1)
    for kind in distillation.DIVERGENCES:
        assert distillation.divergence(t, t, kind).abs().max() < 1e-6, kind
        assert (distillation.divergence(t, s, kind) > 1e-3).all(), kind
    kl = (t.exp() * (t - s)).sum(-1)
    torch.testing.assert_close(distillation.divergence(t, s, "forward_kl"), kl)
    torch.testing.assert_close(
        distillation.divergence(t, s, "reverse_kl"), (s.exp() * (s - t)).sum(-1)
    )
    torch.testing.assert_close(
        distillation.divergence(t, s, "tv"), 0.5 * (t.exp() - s.exp()).abs().sum(-1)
    )
    jsd = distillation.divergence(t, s, "jsd")
    assert (jsd <= math.log(2) + 1e-6).all()  # JSD is bounded by log 2
    torch.testing.assert_close(jsd, distillation.divergence(s, t, "jsd"))  # symmetric at 0.5


def test_sparse_target_folds_the_rest_into_one_bucket():
    g = torch.Generator().manual_seed(1)
    s_logits = torch.randn(4, 9, generator=g, requires_grad=True)
    t_logits = torch.randn(4, 9, generator=g)
    # Every token listed: the sparse divergence is the dense one.
    ids, logp = distillation.top_k_sparse(t_logits, 9)
    for kind in distillation.DIVERGENCES:
        torch.testing.assert_close(
            distillation.sparse_divergence(s_logits, ids, logp, kind),
            distillation.dense_divergence(s_logits, t_logits, kind),
            atol=2e-5,
            rtol=1e-4,
        )
    # Top-2 with a padded third entry (-inf): finite, and zero when the student agrees exactly.
    ids, logp = distillation.top_k_sparse(t_logits, 2)
    ids = torch.cat([ids, torch.zeros_like(ids[:, :1])], 1)
    logp = torch.cat([logp, torch.full_like(logp[:, :1], -math.inf)], 1)
    loss = distillation.sparse_divergence(s_logits, ids, logp, "forward_kl")
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(s_logits.grad).all() and s_logits.grad.abs().sum() > 0
    same = distillation.sparse_divergence(t_logits, ids, logp, "forward_kl")
    assert same.abs().max() < 1e-4


# --- settings ----------------------------------------------------------------------------------
def test_where_the_target_distribution_comes_from():
    cfg = load_config("configs/ci.yaml")
    assert cfg.kd_source() is None and cfg.requested_logprobs() is None
    kd = load_config("configs/ci.yaml", ["train.objective=kd"])
    assert kd.kd_source() == "target" and kd.requested_logprobs() is None
    remote = ["teacher.url=http://h/v1", "train.objective=kd", "train.top_logprobs=20"]
    assert load_config("configs/ci.yaml", remote).kd_source() == "teacher"
    assert load_config("configs/ci.yaml", remote).requested_logprobs() == 20
    weights = load_config("configs/ci.yaml", [*remote, "train.kd_source=target"])
    assert weights.kd_source() == "target" and weights.requested_logprobs() is None
    on_policy = load_config("configs/ci.yaml", [*remote[:1], "train.objective=on_policy"])
    assert on_policy.kd_source() == "target"


@pytest.mark.parametrize(
    "sets, words",
    [
        (["train.objective=kd", "train.kd_source=teacher"], ["train.top_logprobs"]),
        (["train.top_logprobs=21"], ["train.top_logprobs"]),
        (["train.divergence=kl"], ["train.divergence"]),
    ],
)
def test_settings_that_cannot_work_are_refused(sets, words):
    with pytest.raises(ConfigError) as err:
        load_config("configs/ci.yaml", sets)
    assert all(w in str(err.value) for w in words), str(err.value)


# --- training ----------------------------------------------------------------------------------
def _gap_to_target(art, draft_dir, kind, n=6) -> float:
    """Mean divergence(target, draft) over the answer tokens of the first n training answers."""
    cfg = load_config("configs/ci.yaml")
    from pipeline.distillation import build_examples
    from pipeline.teacher import load_answers
    from pipeline.workspace import Workspace

    ws = Workspace(art)
    target_ref, _ = specs.resolve_pair(cfg.models.target, cfg.models.draft, ws.models_cache)
    tok = models.load_tokenizer(target_ref)
    rows, _ = build_examples(list(load_answers(ws.answers_file).values())[:n], tok, {}, 512)
    batch = distillation.Collator(tok.pad_token_id)(rows)
    at = distillation.shifted(batch["completion_mask"])
    args = (batch["input_ids"], batch["attention_mask"], at)
    t = distillation.teacher_logits(models.load_model(target_ref, "float32", "cpu"), *args)
    s = distillation.teacher_logits(models.load_model(str(draft_dir), "float32", "cpu"), *args)
    return distillation.dense_divergence(s, t, kind).mean().item()


@pytest.mark.parametrize(
    "objective",
    [
        pytest.param(
            ("train.objective=kd", "train.divergence=tv"), marks=pytest.mark.slow, id="kd-dense-tv"
        ),
        pytest.param(("train.objective=kd", "train.top_logprobs=4"), id="kd-top4"),
        pytest.param(
            ("train.objective=on_policy", "train.on_policy_ratio=1.0", "train.on_policy_tokens=8"),
            id="on-policy",  # dense, from the target's weights
        ),
    ],
)
def test_objectives_move_the_draft_toward_the_target(distilled_ws, tmp_path, objective):
    art = copy_workspace(distilled_ws, tmp_path / "art")
    sets = ("distill.limit=100", "train.max_steps=30", "train.learning_rate=0.003", *objective)
    build_workspace(art, ("train",), sets)
    metrics = json.loads((art / "adapter" / "metrics.json").read_text())
    assert metrics["objective"] == objective[0].split("=")[1]
    assert metrics["kd_source"] == "target" and metrics["global_steps"] == 30
    log = [json.loads(x) for x in (art / "adapter" / "train_log.jsonl").read_text().splitlines()]
    assert all("teacher_match" in h for h in log)
    if "on_policy" in objective[0]:
        assert all(h["on_policy_batches"] == 1.0 for h in log)  # ratio 1: the draft wrote all
    cfg = load_config("configs/ci.yaml")
    _, base = specs.resolve_pair(cfg.models.target, cfg.models.draft, art / "cache" / "models")
    kind = next((x.split("=")[1] for x in objective if "divergence" in x), "forward_kl")
    before = _gap_to_target(art, base, kind)
    after = _gap_to_target(art, art / "adapter" / "model", kind)
    # 30 steps close 9-17% of the gap, depending on the session's teacher answers (they varied
    # with test order: 9% in two full-suite runs, 14-17% alone); at least 5% is "moved toward".
    assert after < 0.95 * before, (before, after)


# --- logprobs from a remote teacher ------------------------------------------------------------
def _remote_config(tmp_path, url, **train):
    cfg = yaml.safe_load(open("configs/ci.yaml"))
    cfg["teacher"].update(url=url, model="fake", max_tokens=16, ready_timeout_s=20)
    cfg["data"].update(train_size=40, test_size=10)
    cfg["train"].update(
        objective="kd", top_logprobs=3, max_steps=10, batch_size=4, learning_rate=0.01, **train
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _answers(art):
    path = art / "teacher" / "answers.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def split_ws(tmp_path, cli):
    if not MBPP.is_file():
        pytest.skip(f"{MBPP} not present")
    art = tmp_path / "art"
    assert cli("split", *CI, "--artifacts", art, "--set", "data.train_size=40").returncode == 0
    return art


def test_kd_learns_from_a_remote_teacher_top_logprobs(split_ws, tmp_path, cli):
    with FakeOpenAI() as fake:
        cfg = _remote_config(tmp_path, fake.url)
        r = cli("distill", "--config", cfg, "--artifacts", split_ws, "--set", "distill.limit=12")
        assert r.returncode == 0, r.log
    assert all(b.get("logprobs") is True and b["top_logprobs"] == 3 for b in fake.chat_bodies)
    rows = _answers(split_ws)
    assert len(rows) == 12
    assert all(len(r["completion_logprobs"]) == len(r["completion"]) for r in rows)
    assert all(len(e[2]) == 3 for r in rows for e in r["completion_logprobs"])
    r = cli("train", "--config", cfg, "--artifacts", split_ws)
    assert r.returncode == 0, r.log
    metrics = json.loads((split_ws / "adapter" / "metrics.json").read_text())
    assert metrics["kd_source"] == "teacher" and metrics["objective"] == "kd"
    assert metrics["last_loss"] < metrics["first_loss"]


def test_the_local_teacher_gives_kd_its_logprobs_and_samples_when_asked(split_ws, cli):
    """Phoenix's own server as the teacher: top_logprobs as token ids (exact), every answer
    token with its top 3; at a temperature the answers are sampled, seeded by task."""
    sets = ["distill.limit=3", "teacher.max_tokens=12", "train.objective=kd",
            "train.kd_source=teacher", "train.top_logprobs=3", "teacher.temperature=0.9"]  # fmt: skip
    r = cli("distill", *CI, "--artifacts", split_ws, *[x for s in sets for x in ("--set", s)])
    assert r.returncode == 0, r.log
    rows = _answers(split_ws)
    assert len(rows) == 3 and any(row["completion_logprobs"] for row in rows)
    for row in rows:
        lps = row["completion_logprobs"]
        assert [e[0] for e in lps] == [f"token_id:{i}" for i in row["completion_token_ids"]]
        assert all(len(e[2]) == 3 and e[1] <= e[2][0][1] + 1e-6 for e in lps)


def test_an_sft_answer_file_is_asked_again_for_logprobs(split_ws, tmp_path, cli):
    with FakeOpenAI() as fake:
        sft = _remote_config(tmp_path, fake.url, kd_source="target")
        r = cli("distill", "--config", sft, "--artifacts", split_ws, "--set", "distill.limit=4")
        assert r.returncode == 0, r.log
        assert all("logprobs" not in b for b in fake.chat_bodies)
        kd = _remote_config(tmp_path, fake.url)
        r = cli("distill", "--config", kd, "--artifacts", split_ws, "--set", "distill.limit=4")
        assert r.returncode == 0, r.log
    assert sum(b.get("logprobs") is True for b in fake.chat_bodies) == 4
    from pipeline.teacher import load_answers

    kept = load_answers(split_ws / "teacher" / "answers.jsonl")
    assert len(kept) == 4 and all("completion_logprobs" in r for r in kept.values())


@pytest.mark.parametrize("mode, words", [("none", "returned none"), ("wrong", "do not spell")])
def test_a_teacher_without_usable_logprobs_stops_distill(split_ws, tmp_path, cli, mode, words):
    with FakeOpenAI(logprobs=mode) as fake:
        cfg = _remote_config(tmp_path, fake.url)
        r = cli("distill", "--config", cfg, "--artifacts", split_ws, "--set", "distill.limit=6")
    assert r.returncode == 2, r.log
    assert words in r.log and "train.objective=kd" in r.log and fake.url in r.log
    assert _answers(split_ws) == []  # nothing half-usable written


def test_stored_logprobs_that_do_not_match_name_the_row(split_ws, tmp_path, cli):
    with FakeOpenAI() as fake:
        cfg = _remote_config(tmp_path, fake.url)
        r = cli("distill", "--config", cfg, "--artifacts", split_ws, "--set", "distill.limit=4")
        assert r.returncode == 0, r.log
    path = split_ws / "teacher" / "answers.jsonl"
    rows = _answers(split_ws)
    rows[2]["completion_logprobs"][0][0] = "\u2603\u2603"  # a token the tokenizer has not
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = cli("train", "--config", cfg, "--artifacts", split_ws)
    assert r.returncode == 2, r.log
    assert f"task_id {rows[2]['task_id']}" in r.log
    assert not (split_ws / "adapter" / "model").exists()


def test_kd_without_the_target_weights_names_the_objective_and_teacher(split_ws, tmp_path, cli):
    empty = tmp_path / "target-weights-not-here"  # e.g. a mount that is missing its files
    empty.mkdir()
    with FakeOpenAI() as fake:
        cfg = _remote_config(tmp_path, fake.url, kd_source="target")
        r = cli("distill", "--config", cfg, "--artifacts", split_ws, "--set", "distill.limit=4")
        assert r.returncode == 0, r.log
        r = cli(
            "train",
            *("--config", cfg, "--artifacts", split_ws),
            *("--set", f"models.target={empty}"),
            *("--set", "models.draft=tiny:layers=1,hidden=64,seed=0"),
        )
    assert r.returncode == 2, r.log
    assert "train.objective=kd" in r.log and fake.url in r.log and "train.kd_source" in r.log
