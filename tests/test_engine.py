import pytest

from pipeline.spec.engine import SpecEngine

PROMPTS = [
    "Write a function to add two numbers.",
    "hello",
    "Sort a list of tuples by the second item, please.",
]


def ids_for(tok, text):
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tok(rendered, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def engines(tiny_models):
    tok, target, draft = tiny_models
    eos = [tok.eos_token_id]
    return tok, SpecEngine(target, draft, eos), SpecEngine(target, target, eos)


@pytest.mark.parametrize("k", [1, 2, 4, 6, 8])
def test_greedy_output_equals_target_alone_for_every_arm(engines, k):
    tok, cut, selfdraft = engines
    for text in PROMPTS:
        ids = ids_for(tok, text)
        ref = cut.generate(ids, 0, 40)
        assert ref.output_tokens > 0
        for eng in (cut, selfdraft):
            r = eng.generate(ids, k, 40)
            assert r.token_ids == ref.token_ids
            assert r.finish_reason == ref.finish_reason


def test_target_only_matches_transformers_generate(engines, tiny_models):
    import torch

    tok, cut, _ = engines
    target = tiny_models[1]
    ids = ids_for(tok, PROMPTS[0])
    ours = cut.generate(ids, 0, 30)
    hf = target.generate(
        torch.tensor([ids]),
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    expected = hf[0, len(ids) :].tolist()
    if tok.eos_token_id in expected:
        expected = expected[: expected.index(tok.eos_token_id)]
    assert ours.token_ids == expected


def test_counts_are_consistent(engines):
    tok, cut, selfdraft = engines
    ids = ids_for(tok, PROMPTS[2])
    r = selfdraft.generate(ids, 4, 40)
    # The target drafting for itself is always right.
    assert r.accepted == r.proposed > 0 and r.acceptance == 1.0
    assert r.accepted_per_position == r.proposed_per_position
    c = cut.generate(ids, 4, 40)
    assert c.proposed == sum(c.proposed_per_position) and c.accepted == sum(c.accepted_per_position)
    assert all(
        a <= p for a, p in zip(c.accepted_per_position, c.proposed_per_position, strict=True)
    )
    # Acceptance at position i needs acceptance at every earlier position.
    assert all(
        x >= y for x, y in zip(c.accepted_per_position, c.accepted_per_position[1:], strict=False)
    )
    assert c.output_tokens <= 40 and c.latency_s >= c.draft_s + c.verify_s - 1e-3


def test_arm_zero_does_no_draft_work(engines):
    tok, cut, _ = engines
    r = cut.generate(ids_for(tok, "hello"), 0, 20)
    assert r.proposed == 0 and r.draft_s == 0.0 and r.acceptance is None


def test_max_new_tokens_is_exact(engines):
    tok, _, selfdraft = engines
    ids = ids_for(tok, PROMPTS[0])
    for n in (1, 2, 5, 9):
        r = selfdraft.generate(ids, 8, n)
        assert r.output_tokens <= n
        if r.finish_reason == "length":
            assert r.output_tokens == n


def test_should_stop_and_streaming_callback(engines):
    tok, cut, _ = engines
    seen = []
    r = cut.generate(
        ids_for(tok, "hello"), 2, 40, on_tokens=seen.extend, should_stop=lambda out: len(out) >= 5
    )
    assert r.finish_reason == "stop" and 5 <= r.output_tokens <= 7 and seen == r.token_ids


def test_arm_without_draft_is_refused(tiny_models):
    tok, target, _ = tiny_models
    with pytest.raises(ValueError, match="needs a draft"):
        SpecEngine(target).generate([1, 2], 2, 5)


def test_batched_target_generation_equals_one_at_a_time(engines):
    tok, cut, _ = engines
    prompts = [ids_for(tok, t) for t in PROMPTS + ["x", "Write a long story about a function."]]
    limits = [30, 12, 30, 5, 25]
    batch = cut.generate_batch(prompts, limits)
    for p, n, b in zip(prompts, limits, batch, strict=True):
        single = cut.generate(p, 0, n)
        assert b.token_ids == single.token_ids and b.finish_reason == single.finish_reason


def test_rows_joining_a_running_batch_get_one_at_a_time_output(engines):
    """Continuous batching: rows added between steps (shorter and longer prompts than the
    running rows' cache) decode exactly as they would alone; finished rows leave at once."""
    from pipeline.spec.engine import TargetBatch

    tok, cut, _ = engines
    first = [ids_for(tok, "hello"), ids_for(tok, PROMPTS[0])]
    later = [ids_for(tok, "x"), ids_for(tok, PROMPTS[2] + " And explain it at length, please.")]
    batch = TargetBatch(cut)
    batch.add([("a", (first[0], 20)), ("b", (first[1], 3))])
    done = {}
    for _ in range(4):
        done.update(batch.step())
    assert list(done) == ["b"] and batch.active == 1  # b finished after 3 tokens and left
    batch.add([("c", (later[0], 15)), ("d", (later[1], 25))])
    assert batch.active == 3
    while batch.active:
        done.update(batch.step())
    for key, (ids, n) in {
        "a": (first[0], 20),
        "b": (first[1], 3),
        "c": (later[0], 15),
        "d": (later[1], 25),
    }.items():
        single = cut.generate(ids, 0, n)
        assert done[key].token_ids == single.token_ids, key
        assert done[key].finish_reason == single.finish_reason
    assert batch.step() == [] and batch.cache is None


def test_skinny_linears_match_plain_linear_and_leave_training_alone():
    import torch
    import torch.nn.functional as F

    from pipeline.spec.engine import SKINNY_MAX_ROWS, use_skinny_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8, bias=False))
    assert use_skinny_linears(model) == 2 and use_skinny_linears(model) == 2  # idempotent
    for rows in (1, 2, 5, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 3):
        x = torch.randn(1, rows, 24)
        with torch.inference_mode():
            got = model(x)
            want = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
        assert got.shape == (1, rows, 8) and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # With grad enabled (training) the plain path runs and gradients flow.
    model(torch.randn(3, 24)).sum().backward()
    assert model[0].weight.grad is not None
