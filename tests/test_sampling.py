"""Speculative sampling is lossless in distribution, and logprobs are the target's.

Token identity no longer applies under sampling, so these tests compare distributions: the
tokens a speculative arm generates at positions 1-3, over thousands of seeds, against the tokens
target-only sampling generates, with a chi-square two-sample test at significance ALPHA (the
seeds are fixed, so each test is deterministic). Negative controls run through the same test
and must be rejected, so the test can see a wrong rule: one that always accepts, and a subtler
one that resamples a rejection from the target's whole distribution instead of the residual
max(0, p - q).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pipeline import eagle3
from pipeline.models import user_prompt_ids
from pipeline.speculative import batch as batch_mod
from pipeline.speculative import sampling as sm
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch, sample_outputs
from pipeline.speculative.loaded import Models
from pipeline.speculative.sampling import Sampling, chi_square, draw, probabilities, verify
from tests.conftest import target_greedy

ALPHA = 1e-3  # each comparison's significance
SAMPLES = 1000  # generations per arm
POSITIONS = 3  # output positions compared
# Peaked enough that a few thousand samples resolve it (the tiny model's vocabulary is 259).
SAMPLED = dict(temperature=0.8, top_k=12, top_p=0.95)


def test_chi_square_sees_a_difference_and_accepts_a_match():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    same = [torch.multinomial(p, 1, generator=g).item() for _ in range(3000)]
    same2 = [torch.multinomial(p, 1, generator=g).item() for _ in range(3000)]
    other = [torch.multinomial(torch.tensor([0.4, 0.35, 0.25]), 1, generator=g).item()
             for _ in range(3000)]  # fmt: skip
    assert chi_square(same, same2)[1] > ALPHA
    assert chi_square(same, other)[1] < ALPHA


# -- broken rules: the negative controls -----------------------------------------------------------
def always_accept(drafts, q, p, g):
    return len(drafts), draw(p[len(drafts)], g)


def no_residual(drafts, q, p, g):
    """Accepts as `verify` does, but a rejection draws from p instead of max(0, p - q)."""
    for i, d in enumerate(drafts):
        qd = 1.0 if q is None else float(q[i, d])
        if float(torch.rand((), generator=g)) * qd >= float(p[i, d]):
            return i, draw(p[i], g)
    return len(drafts), draw(p[len(drafts)], g)


# -- the rule alone: the first committed token is distributed as p[0] ---------------------------
def _first_tokens(q_kind: str, k: int, n: int, rule=verify) -> tuple[list, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    vocab = 6
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    out = []
    for _ in range(n):
        if q_kind == "model":
            drafts = [draw(q[i], g) for i in range(k)]
            m, nxt = rule(drafts, q, p, g)
        else:  # prompt lookup: a fixed guess, q a point mass
            drafts = [int(p[0].argmax())] * k
            m, nxt = rule(drafts, None, p, g)
        out.append((drafts[:m] + [nxt])[0])
    return out, p[0]


@pytest.mark.parametrize("q_kind", ["model", "point"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_rejection_rule_keeps_the_targets_distribution(q_kind, k):
    n = 3000
    got, p0 = _first_tokens(q_kind, k, n)
    ref = torch.multinomial(p0, n, replacement=True, generator=torch.Generator().manual_seed(9))
    assert chi_square(got, ref.tolist())[1] > ALPHA
    for rule in (always_accept, no_residual):
        wrong, _ = _first_tokens(q_kind, k, n, rule)
        assert chi_square(wrong, ref.tolist())[1] < ALPHA, rule.__name__


def test_probabilities_cut_by_top_k_and_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = probabilities(logits, Sampling(temperature=1.0, top_k=3))
    assert (p[3:] == 0).all() and abs(float(p.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)  # 0.636, 0.234, 0.086, ...
    p = probabilities(logits, Sampling(temperature=1.0, top_p=0.8))
    assert (p[:2] > 0).all() and (p[2:] == 0).all()  # 0.636 < 0.8 <= 0.636 + 0.234
    assert torch.allclose(p[:2], full[:2] / full[:2].sum())
    p = probabilities(logits, Sampling(temperature=1.0, top_p=0.1))
    assert p[0] == 1  # the most likely token always stays
    assert torch.allclose(
        probabilities(logits, Sampling(temperature=0.5)), torch.softmax(logits / 0.5, -1)
    )


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=2.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(logprobs=21),
    ],  # fmt: skip
)
def test_sampling_refuses_values_out_of_range(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).replace("logprobs", "top_logprobs")):
        Sampling(**bad)


# -- the step loop, on a tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_models):
    tok, target, draft = tiny_models
    torch.manual_seed(0)  # an EAGLE-3 head started from the target: the eagle:K arms
    head = eagle3.new_head(target, list(range(target.config.vocab_size)), None).eval()
    draft = copy.deepcopy(draft)
    draft.config.pard_token = 5  # a mask id: the pard:K arms (untrained masks guess poorly)
    return tok, Models(target, draft, [tok.eos_token_id], head=head)


def generate_many(eng, prompt, arm, n, seed0, tokens=POSITIONS, rows=64, **kw):
    return sample_outputs(eng, prompt, parse_arm(arm), n, tokens, Sampling(seed=seed0, **kw), rows)


def _compare(spec: list, ref: list) -> list[float]:
    return [chi_square([o[i] for o in spec], [o[i] for o in ref])[1] for i in range(POSITIONS)]


PROMPT_TEXT = "abc abc abc abc abc ab"  # repeats: prompt lookup proposes


@pytest.fixture(scope="module")
def reference_samples(engine):
    tok, eng = engine
    prompt = user_prompt_ids(tok, PROMPT_TEXT)
    return prompt, generate_many(eng, prompt, "0", SAMPLES, seed0=0, **SAMPLED)[0]


SAMPLED_ARMS = [f"{s}:{k}" for s in ("draft", "ngram", "eagle") for k in (1, 2, 4)]
SAMPLED_ARMS += ["pard:4"]  # its three guesses cover every position compared


@pytest.mark.parametrize("arm", SAMPLED_ARMS)
def test_speculative_sampling_matches_target_only_sampling(engine, reference_samples, arm):
    """Every strategy at k = 1, 2, 4: the tokens at positions 1-3 are distributed as target-only
    sampling's (no position rejects at ALPHA); the same comparison rejects the broken rules
    for the same arm (the always-accept one with a quarter of the samples: it is far off)."""
    _, eng = engine
    prompt, ref = reference_samples
    seed0 = 100_000 * (1 + SAMPLED_ARMS.index(arm))
    spec, proposed = generate_many(eng, prompt, arm, SAMPLES, seed0, **SAMPLED)
    assert proposed > SAMPLES // 4, f"{arm} proposed only {proposed} guesses: nothing tested"
    pvalues = _compare(spec, ref)
    assert min(pvalues) > ALPHA, f"{arm}: p-values by position {pvalues}"

    saved = batch_mod.verify
    try:
        # A point-mass guess the target rejects is rarely one it favours, so for prompt lookup
        # drawing from p instead of the residual moves the output too little to see here.
        controls = [(always_accept, SAMPLES // 4)]
        # The eagle head here starts from the target's own last layer and head, so its q is
        # close to p and skipping the residual moves the output too little to see as well.
        if arm.startswith(("draft", "pard")):
            controls.append((no_residual, SAMPLES))
        for rule, n in controls:
            batch_mod.verify = rule  # a negative control: a rule the test must catch
            wrong, _ = generate_many(eng, prompt, arm, n, seed0 + 50_000, **SAMPLED)
            assert min(_compare(wrong, ref)) < ALPHA, f"{arm}: {rule.__name__} passed"
    finally:
        batch_mod.verify = saved


def test_a_seed_reproduces_its_output_and_greedy_stays_exact(engine):
    tok, eng = engine
    prompt = user_prompt_ids(tok, "Write a function to add two numbers.")
    for arm in ("0", "draft:2", "ngram:2"):
        a, _ = generate_many(eng, prompt, arm, 3, seed0=7, tokens=12, temperature=1.0)
        b, _ = generate_many(eng, prompt, arm, 3, seed0=7, tokens=12, temperature=1.0)
        assert a == b
        assert len(set(a)) > 1  # different seeds, different samples
    ref = target_greedy(eng.target, prompt, 12, tok.eos_token_id)
    for arm in ("0", "draft:4"):
        out, _ = generate_many(eng, prompt, arm, 1, seed0=0, tokens=12, temperature=0.0)
        assert [t for t in out[0] if t is not None] == ref


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("arm", ["0", "draft:3"])
def test_logprobs_are_the_targets_own(engine, arm, temperature):
    """Each emitted token's logprob and its top 5 equal a plain forward's log-softmax over the
    prompt + output so far (greedy and sampled, plain and speculative rows)."""
    tok, eng = engine
    prompt = user_prompt_ids(tok, "Sort a list of tuples by the second item, please.")
    batch = RowBatch(eng, max_rows=2)
    batch.join([(0, prompt, 10, parse_arm(arm), Sampling(temperature, seed=3, logprobs=5))])
    while batch.rows:
        done = batch.step()
    row = done[0][0]
    assert len(row.logprobs) == len(row.out) > 0
    with torch.inference_mode():
        logits = eng.target(torch.tensor([prompt + row.out])).logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    for j, (tok_lp, top) in enumerate(row.logprobs):
        assert math.isclose(tok_lp, float(lp[j, row.out[j]]), abs_tol=1e-4)
        ids = [t for t, _ in top]
        assert len(top) == 5 and ids[0] == int(lp[j].argmax())
        assert all(math.isclose(v, float(lp[j, t]), abs_tol=1e-4) for t, v in top)


def test_greedy_rows_draw_nothing(engine):
    assert Sampling().generator() is None and sm.GREEDY.greedy
