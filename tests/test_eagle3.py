"""The EAGLE-3 head: training sees what drafting sees, the hidden-state cache is keyed, the
speculators export round-trips, and a trained head learns the target's tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline import distillation, eagle3, models, train
from pipeline.speculative.eagle3 import HeadCache
from pipeline.speculative.eagle3_config import config_from_target, default_aux_layers
from tests.conftest import target_greedy


@pytest.fixture(scope="module")
def target(tiny_models):
    return tiny_models[1]


def _head(target, vocab=None, seed=0):
    torch.manual_seed(seed)
    n = target.config.vocab_size
    return eagle3.new_head(target, vocab or list(range(n)), None).eval()


def _aux(target, seq, aux_ids):
    with torch.no_grad():
        o = target(input_ids=torch.tensor([seq]), output_hidden_states=True)
    return torch.cat([o.hidden_states[a][0] for a in aux_ids], dim=-1)


def test_training_time_test_scores_what_drafting_scores(target):
    """Step j of `ttt_logits` at query t equals the head's (j+1)-th drafting step after
    committed x_0..x_{t+1} when its guesses are the sequence's own tokens: the attention
    training sees (step-0 keys of the context plus the chain's own) is drafting's."""
    head = _head(target)
    seq = [5 + (i * 7) % 90 for i in range(24)]
    aux = _aux(target, seq, head.config.aux_layer_ids)
    steps = 3
    with torch.no_grad():
        ttt = head.ttt_logits(torch.tensor([seq]), aux[None], steps)
    for t in (4, 11, 17):
        m = t + 1  # committed x_0..x_m; the first guess is scored at position m - 1 = t
        cache = HeadCache()
        with torch.no_grad():
            logits, pre = head.forward_step(
                torch.tensor([seq[1 : m + 1]]), head.fuse(aux[:m])[None], 0, cache
            )
            got = [logits[0, -1]]
            for j in range(1, steps):
                logits, pre = head.forward_step(
                    torch.tensor([[seq[m + j]]]), pre[:, -1:], m + j - 1, cache
                )
                got.append(logits[0, -1])
        for j in range(steps):
            torch.testing.assert_close(got[j], ttt[j][0, t], atol=1e-4, rtol=1e-4)


def test_propose_keeps_only_committed_positions_and_matches_a_fresh_cache(target):
    head = _head(target, seed=1)
    seq = [3 + (i * 5) % 80 for i in range(30)]
    aux = _aux(target, seq, head.config.aux_layer_ids)
    cache = HeadCache()
    first = head.propose(seq[:12], aux[:11], cache, 4)
    assert cache.length == 11 and len(first) == 4
    later = head.propose(seq[:20], aux[:19], cache, 3)  # catches up 8 committed positions
    assert cache.length == 19
    assert later == head.propose(seq[:20], aux[:19], HeadCache(), 3)


def test_a_head_cache_grows_and_crops_as_one_long_concatenation():
    """Appends past the buffer's capacity (64, then doubled), with crops between them, read
    back exactly what concatenating the kept positions gives."""
    torch.manual_seed(0)
    cache, kept_k, kept_v = HeadCache(), torch.zeros(1, 3, 0, 8), torch.zeros(1, 3, 0, 8)
    for n, crop in ((40, 38), (30, 60), (1, 61), (90, 150)):
        k, v = torch.randn(1, 3, n, 8), torch.randn(1, 3, n, 8)
        got_k, got_v = cache.append(k, v)
        kept_k, kept_v = torch.cat([kept_k, k], 2), torch.cat([kept_v, v], 2)
        assert torch.equal(got_k, kept_k) and torch.equal(got_v, kept_v)
        cache.crop(crop)
        kept_k, kept_v = kept_k[:, :, :crop], kept_v[:, :, :crop]
        assert cache.length == kept_k.shape[2]
    assert cache.k.shape[2] == 256  # 64, 128 at 68 positions, 256 at 61 + 90


def test_rows_drafting_together_guess_what_each_guesses_alone(target):
    """`draft_many`: sequences of different lengths and caches, each with its own k (1 included),
    one head pass per position over all of them, score and guess what each does alone (the
    padding masked out), and leave each cache at its committed positions."""
    head = _head(target, seed=2)
    seqs = [[3 + (i * p) % 80 for i in range(n)] for p, n in ((5, 30), (7, 18), (11, 25))]
    auxs = [_aux(target, s, head.config.aux_layer_ids) for s in seqs]
    ks, ends, read = [4, 1, 3], [12, 17, 21], [0, 0, 9]  # the third cache has read 9 already

    def run(together: bool):
        scores: list[list[torch.Tensor]] = [[] for _ in seqs]
        jobs = []
        for i, (s, a, k, m, r) in enumerate(zip(seqs, auxs, ks, ends, read, strict=True)):
            c = HeadCache()
            if r:
                head.propose(s[: r + 1], a[:r], c, 2)

            def choose(x, i=i):
                scores[i].append(x.clone())
                return int(x.argmax())

            jobs.append((s[: m + 1], a[r:m], c, k, choose))
        out = head.draft_many(jobs) if together else [head.draft(*j) for j in jobs]
        assert [j[2].length for j in jobs] == ends
        return out, scores

    (alone, a_scores), (both, b_scores) = run(False), run(True)
    assert both == alone and [len(x) for x in b_scores] == ks
    for x, y in zip(a_scores, b_scores, strict=True):
        for p, q in zip(x, y, strict=True):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-5)


def test_aux_layers_default_to_vllms_choice_and_bad_ones_are_refused(target):
    n = target.config.num_hidden_layers
    assert config_from_target(target.config, 0).aux_layer_ids == default_aux_layers(n)
    assert default_aux_layers(30) == (2, 15, 27)
    assert default_aux_layers(4) == (0, 2, 3)  # vLLM taps a layer once: three distinct ones
    assert all(len(set(default_aux_layers(n))) == 3 for n in range(3, 40))
    with pytest.raises(ValueError, match="three target layers"):
        config_from_target(target.config, 0, (0, 1, n))


def test_export_is_the_speculators_layout_and_loads_back_identically(target, tmp_path):
    vocab = list(range(0, target.config.vocab_size, 2))
    head = _head(target, vocab, seed=2)
    out = tmp_path / "head"
    eagle3.export(head, out, "tiny-target", ["LlamaForCausalLM"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and "model_type" not in cfg
    assert cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == len(vocab)
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.long
        assert f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names  # fmt: skip
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        # The target's own rows: speculators' loader would leave a missing one zeros.
        embed = f.get_tensor("embed_tokens.weight")
    assert torch.equal(embed, target.get_input_embeddings().weight.float())
    back = eagle3.load_head(out, target, "tiny-target")
    assert back.target_ids.tolist() == vocab
    seq = [7 + i for i in range(16)]
    aux = _aux(target, seq, head.config.aux_layer_ids)
    assert back.propose(seq, aux[:15], HeadCache(), 3) == head.propose(
        seq, aux[:15], HeadCache(), 3
    )
    with pytest.raises(ValueError, match="tiny-target.*other-target"):
        eagle3.load_head(out, target, "other-target")
    # A head speculators itself saved has no `phoenix` block: read from its own keys.
    del cfg["phoenix"]
    (out / "config.json").write_text(json.dumps(cfg))
    plain = eagle3.load_head(out, target)
    assert plain.config.aux_layer_ids == head.config.aux_layer_ids
    assert plain.propose(seq, aux[:15], HeadCache(), 3) == head.propose(
        seq, aux[:15], HeadCache(), 3
    )
    # A variant Phoenix's head does not implement is refused, not silently run without it.
    (out / "config.json").write_text(json.dumps({**cfg, "norm_before_residual": True}))
    with pytest.raises(ValueError, match="norm_before_residual"):
        eagle3.load_head(out, target)


def test_full_vocabulary_export_has_no_maps(target, tmp_path):
    head = _head(target)
    eagle3.export(head, tmp_path / "h", "t", ["LlamaForCausalLM"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h" / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys()  # vLLM refuses the maps with the full vocabulary
    assert eagle3.load_head(tmp_path / "h", target).target_ids.tolist() == list(
        range(target.config.vocab_size)
    )


def _rows(tok, n=6):
    answers = [
        {"task_id": i, "prompt": f"Write a function number {i}.", "completion": "def f(x):\n"
         f"    return x + {i}\n", "finish_reason": "stop"}
        for i in range(n)
    ]  # fmt: skip
    rows, _ = distillation.build_examples(answers, tok, {}, 128)
    return rows


def test_states_are_cached_by_target_and_answers_and_resumed(tiny_models, tmp_path):
    tok, target, _ = tiny_models
    rows = _rows(tok)
    aux = default_aux_layers(target.config.num_hidden_layers)
    k1 = eagle3.states_key("w1", rows, aux)
    assert k1 != eagle3.states_key("w2", rows, aux)  # another target
    assert k1 != eagle3.states_key("w1", rows[:-1], aux)  # other answers
    shards = eagle3.cache_states(target, rows, aux, train.pad_id(tok), tmp_path / k1, batch=4)
    data = eagle3.load_shards(shards)
    assert [d["ids"].tolist() for d in data] == [r["input_ids"] for r in rows]
    # kd's distribution: the target's top ids, most likely first (its greedy token), with
    # log-probabilities that sum to at most 1.
    top = data[0]["top_logp"].float()
    assert data[0]["top_ids"].shape == (len(rows[0]["input_ids"]), eagle3.KD_TOP)
    assert torch.equal(data[0]["top_ids"][:, 0].long(), data[0]["greedy"])
    assert (top[:, :-1] >= top[:, 1:]).all() and (top.exp().sum(-1) <= 1.01).all()
    # Batched with padding, each row's states are its own alone.
    alone = _aux(target, rows[0]["input_ids"], aux)
    torch.testing.assert_close(data[0]["aux"].float(), alone, atol=2e-2, rtol=2e-2)
    stamp = shards[0].stat().st_mtime_ns
    eagle3.cache_states(target, rows, aux, train.pad_id(tok), tmp_path / k1)
    assert shards[0].stat().st_mtime_ns == stamp  # resumed: not recomputed


@pytest.mark.parametrize("top", [0, 20], ids=["sft", "kd"])
def test_training_learns_the_targets_next_tokens(tiny_models, tmp_path, top):
    tok, target, _ = tiny_models
    rows = _rows(tok, 8)
    head = eagle3.new_head(target, list(range(target.config.vocab_size)), None)
    aux = head.config.aux_layer_ids
    data = eagle3.load_shards(
        eagle3.cache_states(target, rows, aux, train.pad_id(tok), tmp_path / "s")
    )
    index = head.draft_index()
    before, _ = eagle3.ttt_loss(head, data, 3, index, top)
    fit = eagle3.train_head(head, data, epochs=30, lr=3e-3, batch_size=4, steps=3, top=top)
    after, accs = eagle3.ttt_loss(head, data, 3, index, top)
    assert after.item() < (0.7 if top else 0.5) * before.item(), (
        before,
        after,
    )  # kd: its entropy stays
    assert accs[0] > 0.5, accs
    assert fit["steps"] == 60


def test_kd_is_the_cross_entropy_on_the_targets_top_n_over_the_heads_vocabulary(
    tiny_models, tmp_path
):
    """kd's targets: the target's top-N renormalised over the ids the head can propose. With
    all the mass on the greedy token, kd's loss is sft's; spread, it is the soft
    cross-entropy."""
    tok, target, _ = tiny_models
    head = _head(target)
    aux = head.config.aux_layer_ids
    data = eagle3.load_shards(
        eagle3.cache_states(target, _rows(tok, 4), aux, train.pad_id(tok), tmp_path / "s")
    )
    index = head.draft_index()
    with torch.no_grad():
        sft, _ = eagle3.ttt_loss(head, data, 2, index)
        onehot = [{**d, "top_logp": torch.where(torch.arange(eagle3.KD_TOP) == 0, 0.0, -1e4)
                   .expand_as(d["top_logp"]).to(torch.bfloat16)} for d in data]  # fmt: skip
        same, _ = eagle3.ttt_loss(head, onehot, 2, index, eagle3.KD_TOP)
        spread, _ = eagle3.ttt_loss(head, data, 2, index, eagle3.KD_TOP)
    torch.testing.assert_close(same, sft)
    assert abs(spread.item() - sft.item()) > 1e-3
    # Renormalised over the head's vocabulary: ids it cannot propose get nothing.
    pruned = torch.full((10,), -1)
    pruned[[2, 5, 7]] = torch.tensor([0, 1, 2])
    ids = torch.tensor([[5, 3, 2, 9]])
    logp = torch.tensor([[0.5, 0.2, 0.2, 0.1]]).log()
    d, p = eagle3.kd_targets(ids, logp, pruned)
    assert d.tolist() == [[1, 0, 0, 0]]
    torch.testing.assert_close(p, torch.tensor([[0.5 / 0.7, 0.0, 0.2 / 0.7, 0.0]]))


def test_train_and_merge_an_eagle3_head_through_the_command_line(distilled_ws, tmp_path, cli):
    """models.draft=eagle3: train caches the target's states and trains the head, merge
    verifies and publishes it in the speculators layout with the vLLM command; the engine
    refuses to load it as a draft model, naming what to do; LoRA is refused up front."""
    from tests.conftest import copy_workspace

    art = copy_workspace(distilled_ws, tmp_path / "art")
    base = ("--config", "configs/ci.yaml", "--artifacts", str(art), "--set",
            "models.draft=eagle3")  # fmt: skip
    bad = cli("train", *base, "--set", "train.method=lora")
    assert bad.returncode == 2 and "train.method=lora does not apply" in bad.log
    sets = ("--set", "distill.limit=100", "--set", "train.epochs=1", "--set", "train.ttt_steps=2")
    assert cli("train", *base, *sets).returncode == 0
    metrics = json.loads((art / "adapter" / "metrics.json").read_text())
    assert metrics["method"] == "eagle3" and metrics["ttt_steps"] == 2
    assert metrics["trainable_parameters"] < metrics["target_parameters"]
    states = list((art / "cache" / "eagle3").glob("states-*/shard-*.pt"))
    assert states
    assert cli("merge", *base, *sets).returncode == 0
    cfg = json.loads((art / "merged" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    card = (art / "merged" / "README.md").read_text()
    # The 2-layer tiny target has no three distinct layers to tap: vLLM could not serve it,
    # and the card says so instead of giving a command that would fail (the vLLM tier serves
    # a head of a 4-layer target).
    assert "vLLM cannot serve this head" in card and "speculative-config" not in card
    published = json.loads((art / "merged" / "publish.json").read_text())["published"]
    assert (Path(published["path"]) / "model.safetensors").is_file()
    # Training again on the same answers reuses the cached states (not recomputed), kd too:
    # its distribution is the target's top-N, cached with them.
    stamp = states[0].stat().st_mtime_ns
    kd = cli("train", *base, *sets, "--set", "train.objective=kd", "--force")
    assert kd.returncode == 0, kd.log[-2000:]
    assert states[0].stat().st_mtime_ns == stamp
    metrics = json.loads((art / "adapter" / "metrics.json").read_text())
    assert (metrics["objective"], metrics["kd_source"], metrics["kd_top"]) == ("kd", "target", 20)
    assert cli("merge", *base, *sets, "--set", "train.objective=kd").returncode == 0
    # The bench serves the merged head: its eagle:K rows, lossless (exit 0), in the report.
    served = cli("bench", *base, *sets, "--draft", "distilled",
                 "--set", "bench.fixed_arms=[ngram:2,eagle:2]",
                 "--set", "bandit.arms=[0,ngram:2,eagle:2]")  # fmt: skip
    assert served.returncode == 0, served.log[-2000:]
    results = json.loads((art / "bench" / "results.json").read_text())
    assert any(r["mode"] == "eagle_2" and r["proposed"] for r in results["requests"])
    assert "distilled: eagle3 head" in results["position_acceptance"]


@pytest.fixture(scope="module")
def trained_head(tiny_models, tmp_path_factory):
    tok, target, _ = tiny_models
    rows = []
    for i in range(8):  # as distill's answers are: the target's own greedy outputs
        p = models.user_prompt_ids(tok, f"Write a function number {i}.")
        out = target_greedy(target, p, 24, tok.eos_token_id)
        rows.append({"input_ids": p + out, "completion_mask": [0] * len(p) + [1] * len(out)})
    torch.manual_seed(3)
    head = eagle3.new_head(target, list(range(target.config.vocab_size)), None)
    data = eagle3.load_shards(eagle3.cache_states(
        target, rows, head.config.aux_layer_ids, train.pad_id(tok),
        tmp_path_factory.mktemp("states"),
    ))  # fmt: skip
    eagle3.train_head(head, data, epochs=40, lr=3e-3, batch_size=4, steps=3)
    return head


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_the_step_loop_feeds_the_head_the_states_a_full_forward_gives(
    tiny_models, trained_head, lean
):
    """An eagle:3 row in the step loop guesses what the head guesses from one full forward's
    hidden states over the same committed tokens (the replay of benchmarks/eagle3_head.py):
    the states each verify pass taps reach the head at the right positions. Its output is the
    target's own."""
    from pipeline.speculative.arms import parse_arm
    from pipeline.speculative.batch import RowBatch
    from pipeline.speculative.loaded import Models

    tok, target, _ = tiny_models
    eng = Models(target, None, [tok.eos_token_id], head=trained_head)
    prompt = models.user_prompt_ids(tok, "Write a function number 3.")
    batch = RowBatch(eng, max_rows=2, lean=lean)
    (row,) = batch.join([("a", prompt, 20, parse_arm("eagle:3"))])
    guesses = []
    while batch.rows:
        batch.step()
        guesses.append(list(row.drafts))
    assert row.out == target_greedy(target, prompt, 20, tok.eos_token_id)
    seq = prompt + row.out
    aux = _aux(target, seq, trained_head.config.aux_layer_ids)
    # The loop's first step verifies the first output token too: its rounds start at the
    # prompt's last token (m = len(prompt) - 1), each with k = min(3, budget left - 1).
    cache, m, replayed = HeadCache(), len(prompt) - 1, []
    while m < len(seq) - 1 and len(replayed) < len(guesses):
        k = min(3, 20 - (m - len(prompt) + 1) - 1)
        g = trained_head.propose(seq[: m + 1], aux[:m], cache, k) if k > 0 else []
        replayed.append(g)
        a = 0
        while a < len(g) and g[a] == seq[m + 1 + a]:
            a += 1
        m += a + 1
    assert guesses[: len(replayed)] == replayed
    assert row.accepted > 0  # the trained head's guesses land


def test_a_new_head_between_steps_lets_running_eagle_rows_finish_plain_and_exact(
    tiny_models, trained_head
):
    from pipeline.speculative.arms import parse_arm
    from pipeline.speculative.batch import RowBatch
    from pipeline.speculative.loaded import Models

    tok, target, _ = tiny_models
    eng = Models(target, None, [tok.eos_token_id], head=trained_head)
    prompt = models.user_prompt_ids(tok, "Write a function number 5.")
    batch = RowBatch(eng, max_rows=2)
    (row,) = batch.join([("a", prompt, 16, parse_arm("eagle:3"))])
    batch.step()
    guessed = row.proposed
    other = eagle3.new_head(target, list(range(target.config.vocab_size)), None).eval()
    batch.set_models(Models(target, None, [tok.eos_token_id], head=other))
    while batch.rows:
        batch.step()
    assert guessed > 0 and row.proposed == guessed  # no guess after the swap
    assert row.out == target_greedy(target, prompt, 16, tok.eos_token_id)


def test_a_one_token_prompt_on_an_eagle_arm_is_served_exactly(tiny_models, trained_head):
    """A prompt of one token feeds the target nothing at join (no state for the head yet):
    alone or beside a longer prompt, the eagle row joins, guesses from its first step's states
    on, and its output is the target's own (it was a 500: the prefill of nothing returned no
    states and join read them)."""
    from pipeline.speculative.arms import parse_arm
    from pipeline.speculative.batch import RowBatch
    from pipeline.speculative.loaded import Models

    tok, target, _ = tiny_models
    models_ = Models(target, None, [tok.eos_token_id], head=trained_head)
    longer = models.user_prompt_ids(tok, "Write a function number 2.")
    one = longer[:1]
    for group in ([one], [one, longer]):
        batch = RowBatch(models_, max_rows=2)
        rows = batch.join([(i, p, 12, parse_arm("eagle:2")) for i, p in enumerate(group)])
        while batch.rows:
            batch.step()
        for r, p in zip(rows, group, strict=True):
            assert r.out == target_greedy(target, p, 12, tok.eos_token_id)
        assert rows[0].proposed > 0  # it guessed once it had states
