import types

import pytest
import torch

from pipeline.models import user_prompt_ids
from pipeline.speculative.engine import SpeculativeEngine

PROMPTS = [
    "Write a function to add two numbers.",
    "hello",
    "Sort a list of tuples by the second item, please.",
]


def ids_for(tok, text):
    return user_prompt_ids(tok, text)


@pytest.fixture(scope="module")
def engines(tiny_models):
    tok, target, draft = tiny_models
    eos = [tok.eos_token_id]
    return tok, SpeculativeEngine(target, draft, eos), SpeculativeEngine(target, target, eos)


@pytest.mark.parametrize("k", [1, 2, 4, 6, 8])
def test_greedy_output_equals_target_alone_for_every_arm(engines, k):
    tok, cut, selfdraft = engines
    for text in PROMPTS:
        ids = ids_for(tok, text)
        ref = cut.generate(ids, 0, 24)
        assert ref.output_tokens > 0
        for eng in (cut, selfdraft):
            r = eng.generate(ids, k, 24)
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


SCRIPT_K = 4
SCRIPT_TOKENS = 24


class ScriptedDraft(torch.nn.Module):
    """A draft whose proposals follow a script (nanochat's MockModel, but with a real cache).

    It runs the real tiny draft, so its KV cache is genuinely filled (with rejected proposals
    too) and must genuinely be cropped, then replaces the logits: in every round the first
    `agree` proposals are the target's true next token and every later one is wrong. `truth`
    is prompt + the target's greedy output, so `truth[p]` is the right token at position p.

    A call continues the current round iff it feeds exactly the token proposed last, at the
    position it was proposed for; any other call is the catch-up that opens a new round. At
    every catch-up the cache must hold true tokens only: a rejected proposal left in it means
    the engine did not crop the draft's cache."""

    def __init__(self, inner: torch.nn.Module, truth: list[int], agree: int):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.truth = truth
        self.agree = agree
        self.proposals: list[int] = []  # proposals made, per round with draft work
        self._cache = None
        self._cached: list[int] = []  # the tokens this draft's cache holds, by position
        self._last: tuple[int, int] | None = None  # (position, token) of the last proposal

    def forward(self, input_ids, cache, logits_to_keep=0, **kwargs):
        fed = input_ids[0].tolist()
        start = cache.get_seq_length()
        if cache is not self._cache:  # a new generation
            self._cache, self._cached, self._last = cache, [], None
        if len(fed) == 1 and self._last == (start, fed[0]):
            assert start == len(self._cached), "the draft's cache changed inside a round"
        else:
            assert start <= len(self._cached)
            assert self._cached[:start] == self.truth[:start], "a rejected token stayed cached"
            assert fed == self.truth[start : start + len(fed)], "catch-up fed a wrong token"
            self.proposals.append(0)
        self._cached = self._cached[:start] + fed
        out = self.inner(input_ids=input_ids, cache=cache, logits_to_keep=logits_to_keep, **kwargs)
        pos = start + len(fed)  # the position this call proposes a token for
        right = self.truth[pos]
        tok = right if self.proposals[-1] < self.agree else (right + 1) % self.config.vocab_size
        self.proposals[-1] += 1
        self._last = (pos, tok)
        logits = torch.zeros_like(out.logits)
        logits[0, -1, tok] = 1.0
        return types.SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def script_reference(engines):
    tok, cut, _ = engines
    ids = ids_for(tok, PROMPTS[0])
    ref = cut.generate(ids, 0, SCRIPT_TOKENS)
    # The script needs the target's token at every position a round can propose for.
    assert ref.finish_reason == "length" and ref.output_tokens == SCRIPT_TOKENS
    return ids, ref


@pytest.mark.parametrize("agree", range(SCRIPT_K + 1))
def test_scripted_draft_partial_acceptance_for_every_prefix_length(
    tiny_models, script_reference, agree
):
    """A draft right for exactly `agree` tokens of each round: the engine accepts exactly
    those, commits the target's correction, crops both caches, and its output is still the
    target's own (agree == SCRIPT_K: every round is accepted in full)."""
    tok, target, draft = tiny_models
    ids, ref = script_reference
    scripted = ScriptedDraft(draft, ids + ref.token_ids, agree)
    engine = SpeculativeEngine(target, scripted, [tok.eos_token_id])
    chunks: list[list[int]] = []
    r = engine.generate(ids, SCRIPT_K, SCRIPT_TOKENS, on_tokens=chunks.append)
    assert r.token_ids == ref.token_ids and r.finish_reason == "length"

    # The rounds the script implies: arm k_eff = min(k, tokens left - 1), and the draft is
    # right for min(agree, k_eff) of them, each round committing those plus one more token.
    arms, done = [], 0
    while done < SCRIPT_TOKENS:
        arms.append(min(SCRIPT_K, SCRIPT_TOKENS - done - 1))
        done += min(agree, arms[-1]) + 1
    accepted = [min(agree, a) for a in arms]
    assert [len(c) - 1 for c in chunks] == accepted  # per round, in order
    assert scripted.proposals == [a for a in arms if a > 0]  # the draft ran k_eff times
    assert r.rounds == len(arms)
    assert r.proposed == sum(arms) == sum(r.proposed_per_position)
    assert r.accepted == sum(accepted) == sum(r.accepted_per_position)
    assert r.proposed_per_position == [sum(a > i for a in arms) for i in range(SCRIPT_K)]
    assert r.accepted_per_position == [sum(m > i for m in accepted) for i in range(SCRIPT_K)]
    if agree == 0:
        assert r.accepted == 0 and r.proposed > 0
    if agree == SCRIPT_K:
        assert r.acceptance == 1.0


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
        SpeculativeEngine(target).generate([1, 2], 2, 5)


def test_chosen_linears_match_plain_linear_and_leave_training_alone():
    """Whatever form the probe picks per bucket of rows, a layer computes what F.linear does;
    with grad enabled (training) the plain path runs and gradients flow."""
    import torch
    import torch.nn.functional as F

    from pipeline.speculative.cpu import ALWAYS, BUCKETS, choose_linears, use_linears

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8, bias=False))
    chosen = choose_linears(model, repeat=1)
    assert len(chosen.transposed) == len(BUCKETS) and len(chosen.ms) == len(BUCKETS)
    assert "rows" in chosen.describe()
    for choice in (ALWAYS, chosen):
        assert use_linears(model, choice) == 2 and use_linears(model, choice) == 2  # idempotent
        for rows in (1, 2, 5, 16, 40):
            x = torch.randn(1, rows, 24)
            with torch.inference_mode():
                got = model(x)
                want = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)
            assert got.shape == (1, rows, 8) and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model(torch.randn(3, 24)).sum().backward()
    assert model[0].weight.grad is not None


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    from pipeline.speculative.proposers import NgramProposer as NgramIndex

    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3]
    # Last 3 tokens (7, 2, 3) never occurred before; (2, 3) did, latest at 6..7, followed by 5, 7.
    assert NgramIndex().propose(seq, 2) == [5, 7]
    assert NgramIndex().propose(seq, 10) == [5, 7, 2, 3]  # cut at the end of the sequence
    assert NgramIndex().propose([1, 2, 3, 1, 2, 3], 2) == [1, 2]  # a 3-gram match first
    assert NgramIndex().propose([5, 6, 7, 8], 4) == []  # nothing earlier: no proposal
    assert NgramIndex().propose([4], 3) == []
    idx = NgramIndex()  # incremental: the same answers as a fresh index as the sequence grows
    grown = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
    for n in range(1, len(grown) + 1):
        assert idx.propose(grown[:n], 3) == NgramIndex().propose(grown[:n], 3)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_strategy_is_lossless_and_needs_no_draft(tiny_models, k):
    """ngram:K on an engine without a draft model: output equal to target-only, proposals only
    in rounds that found a match (the others are plain steps), counts consistent."""
    tok, target, _ = tiny_models
    eng = SpeculativeEngine(target, None, [tok.eos_token_id])
    for text in [*PROMPTS, "def f(a): return a + a + a + a + a + a + a"]:
        ids = ids_for(tok, text)
        ref = eng.generate(ids, 0, 32)
        r = eng.generate(ids, k, 32, strategy="ngram")
        assert r.token_ids == ref.token_ids and r.finish_reason == ref.finish_reason
        assert r.arm == f"ngram:{k}" and r.draft_s >= 0
        assert r.proposed == sum(r.proposed_per_position) <= k * r.rounds
        assert r.accepted == sum(r.accepted_per_position) <= r.proposed
        assert r.output_tokens <= r.rounds + r.accepted  # each round: accepted + one token
    with pytest.raises(ValueError, match="needs a draft model"):
        eng.generate(ids, 2, 8)
    with pytest.raises(ValueError, match="unknown draft strategy"):
        eng.generate(ids, 2, 8, strategy="lookahead")


def test_ngram_proposals_that_match_the_target_are_all_accepted(tiny_models, monkeypatch):
    """Proposals equal to the target's own continuation (a lookup that always finds the right
    span): every one is accepted and a round commits k + 1 tokens; the output is unchanged."""
    from pipeline.speculative import proposers

    tok, target, _ = tiny_models
    eng = SpeculativeEngine(target, None, [tok.eos_token_id])
    ids = ids_for(tok, PROMPTS[0])
    ref = eng.generate(ids, 0, 24).token_ids
    assert len(ref) == 24
    monkeypatch.setattr(
        proposers.NgramProposer, "propose", lambda self, seq, k: ref[len(seq) - len(ids) :][:k]
    )
    r = eng.generate(ids, 3, 24, strategy="ngram")
    assert r.token_ids == ref
    assert r.accepted == r.proposed > 0 and r.rounds == 6  # 6 rounds of 3 guesses + 1
