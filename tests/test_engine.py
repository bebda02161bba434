"""The step loop as one request at a time sees it (`batch.generate`): every arm's greedy output
is the target's own (transformers' `generate` is the oracle), a scripted proposer right for
exactly j tokens is accepted for exactly those, and the counts add up."""

import copy

import pytest
import torch

from pipeline.models import user_prompt_ids
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch, generate
from pipeline.speculative.loaded import Models
from pipeline.speculative.propose import Drafts
from pipeline.speculative.propose.ngram import NgramIndex
from tests.conftest import target_greedy

PROMPTS = [
    "Write a function to add two numbers.",
    "hello",
    "Sort a list of tuples by the second item, please.",
]


def ids_for(tok, text):
    return user_prompt_ids(tok, text)


@pytest.fixture(scope="module")
def pairs(tiny_models):
    tok, target, draft = tiny_models
    eos = [tok.eos_token_id]
    return tok, Models(target, draft, eos), Models(target, target, eos)


MASK = 5  # the tiny draft's stand-in mask id: any id of its vocabulary serves the mechanics


def with_mask(model, mask=MASK):
    """A copy of `model` whose config names a parallel-drafting mask token."""
    m = copy.deepcopy(model)
    m.config.pard_token = mask
    return m


@pytest.fixture(scope="module")
def parallel(tiny_models):
    """Models whose draft is the cut draft, and the target itself, each given a mask token."""
    tok, target, draft = tiny_models
    eos = [tok.eos_token_id]
    return Models(target, with_mask(draft), eos), Models(target, with_mask(target), eos)


@pytest.fixture(scope="module")
def oracle(tiny_models):
    tok, target, _ = tiny_models
    return {t: target_greedy(target, ids_for(tok, t), 24, tok.eos_token_id) for t in PROMPTS}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_equals_transformers_generate_for_every_arm(pairs, parallel, oracle, k):
    tok, cut, selfdraft = pairs
    for text in PROMPTS:
        ids = ids_for(tok, text)
        assert oracle[text], "the oracle generated nothing: the check checks nothing"
        for models, arm in ((cut, "0"), (cut, f"draft:{k}"), (selfdraft, f"draft:{k}"),
                            (cut, f"ngram:{k}"), (parallel[0], f"pard:{k}"),
                            (parallel[1], f"pard:{k}")):  # fmt: skip
            r = generate(models, ids, parse_arm(arm), 24)
            assert r.token_ids == oracle[text], (text, arm)
            assert r.finish_reason == ("length" if len(oracle[text]) == 24 else "stop")


def test_counts_are_consistent(pairs):
    tok, cut, selfdraft = pairs
    ids = ids_for(tok, PROMPTS[2])
    r = generate(selfdraft, ids, parse_arm("draft:4"), 40)
    # The target drafting for itself is always right.
    assert r.accepted == r.proposed > 0 and r.acceptance == 1.0
    assert r.accepted_per_position == r.proposed_per_position
    c = generate(cut, ids, parse_arm("draft:4"), 40)
    assert c.proposed == sum(c.proposed_per_position) and c.accepted == sum(c.accepted_per_position)
    assert all(
        a <= p for a, p in zip(c.accepted_per_position, c.proposed_per_position, strict=True)
    )
    # Acceptance at position i needs acceptance at every earlier position.
    pos = c.accepted_per_position
    assert all(x >= y for x, y in zip(pos, pos[1:], strict=False))
    assert c.output_tokens <= 40 and c.cost_s >= c.draft_s > 0


SCRIPT_K = 4
SCRIPT_TOKENS = 24


class ScriptedProposer:
    """A proposer right for exactly `agree` guesses of each step, wrong after (nanochat's
    MockModel, as a proposer): `truth` is prompt + the target's greedy output."""

    taps: tuple[int, ...] = ()

    def __init__(self, truth: list[int], agree: int, vocab: int):
        self.truth, self.agree, self.vocab = truth, agree, vocab
        self.asked: list[int] = []  # k_eff per step it guessed in

    def join(self, rows, states):
        return 0.0

    def propose(self, rows):
        out = []
        for r in rows:
            self.asked.append(r.k_eff)
            right = self.truth[len(r.seq) : len(r.seq) + r.k_eff]
            out.append([t if i < self.agree else (t + 1) % self.vocab for i, t in enumerate(right)])
        return Drafts(out, [[] for _ in rows], None)

    def accepted(self, row, length, states):
        assert row.seq[:length] == self.truth[:length] or length > len(row.seq)

    def leave(self, row):
        pass


@pytest.mark.parametrize("agree", range(SCRIPT_K + 1))
def test_a_proposer_right_for_exactly_j_guesses_gets_exactly_those_accepted(
    pairs, oracle, tiny_models, agree
):
    """The loop accepts exactly the right guesses, commits the target's correction, crops the
    target's cache (the output stays the target's), and counts every position."""
    tok, cut, _ = pairs
    ids = ids_for(tok, PROMPTS[0])
    ref = oracle[PROMPTS[0]]
    assert len(ref) == SCRIPT_TOKENS  # the script needs the target's token at every position
    script = ScriptedProposer(ids + ref, agree, tiny_models[1].config.vocab_size)
    batch = RowBatch(cut, max_rows=1)
    batch._proposers["ngram"] = script  # the loop's proposer surface, scripted
    (row,) = batch.join([(None, ids, SCRIPT_TOKENS, parse_arm(f"ngram:{SCRIPT_K}"))])
    chunks = []
    while batch.rows:
        before = len(row.out)
        batch.step()
        chunks.append(len(row.out) - before)
    assert row.out == ref
    arms, done = [], 0  # per step: k_eff = min(k, tokens left - 1), right for min(agree, k_eff)
    while done < SCRIPT_TOKENS:
        arms.append(min(SCRIPT_K, SCRIPT_TOKENS - done - 1))
        done += min(agree, arms[-1]) + 1
    accepted = [min(agree, a) for a in arms]
    assert [c - 1 for c in chunks] == accepted
    assert script.asked == [a for a in arms if a > 0]
    assert row.rounds == len(arms) and row.proposed == sum(arms) and row.accepted == sum(accepted)
    assert row.proposed_pos == [sum(a > i for a in arms) for i in range(SCRIPT_K)]
    assert row.accepted_pos == [sum(m > i for m in accepted) for i in range(SCRIPT_K)]


def test_the_draft_guesses_its_own_greedy_continuation_after_every_rollback(pairs, tiny_models):
    """Each step the draft model guesses what it would from scratch after the committed
    sequence: its cache held no rejected guess (a crop missed would change its guesses)."""
    tok, cut, _ = pairs
    draft = tiny_models[2]
    batch = RowBatch(cut, max_rows=2)
    rows = batch.join([(i, ids_for(tok, t), 20, parse_arm("draft:3"))
                       for i, t in enumerate(PROMPTS[:2])])  # fmt: skip
    checked = steps_checking(batch, rows, lambda seq, n: target_greedy(draft, seq, n, -1))
    assert checked > 4


def steps_checking(batch, rows, expect) -> int:
    """Step `batch` to the end; at each step every guessing row's guesses must equal
    `expect(its sequence before the step, how many it guessed)`. Returns the checks made."""
    checked = 0
    while batch.rows:
        seqs = {id(r): list(r.seq) for r in batch.rows}
        batch.step()
        for r in rows:
            if id(r) in seqs and r.drafts:
                assert r.drafts == expect(seqs[id(r)], len(r.drafts))
                checked += 1
    return checked


def test_the_parallel_draft_guesses_what_a_fresh_pass_over_the_masks_gives(tiny_models, parallel):
    """Each step a `pard:K` row's K guesses are the draft's greedy picks at its last real token
    and at K-1 mask tokens after it, as one plain forward from scratch gives them: the masks'
    keys never stay in its cache, and rows batched together do not disturb each other."""
    tok = tiny_models[0]
    models = parallel[0]
    draft = models.draft
    batch = RowBatch(models, max_rows=3)
    rows = batch.join([(i, ids_for(tok, t), 20, parse_arm(f"pard:{k}"))
                       for i, (t, k) in enumerate(zip(PROMPTS, (3, 1, 4), strict=True))])  # fmt: skip

    def fresh(seq, n):
        with torch.no_grad():
            logits = draft(torch.tensor([seq + [MASK] * (n - 1)])).logits[0]
        return logits[-n:].argmax(-1).tolist()

    checked = steps_checking(batch, rows, fresh)
    assert checked > 8


def test_a_self_draft_with_untrained_masks_is_right_only_at_its_first_guess(tiny_models, parallel):
    """The target as its own parallel draft: its first guess is the target's next token (always
    accepted); the masks it was never trained on guess (nearly) nothing right."""
    tok = tiny_models[0]
    r = generate(parallel[1], ids_for(tok, PROMPTS[2]), parse_arm("pard:4"), 30)
    assert r.accepted_per_position[0] == r.eligible_per_position[0] > 0
    assert r.proposed_per_position[1] > 0
    assert r.accepted_per_position[1] < r.accepted_per_position[0] / 2


def test_arm_zero_does_no_draft_work(pairs):
    tok, cut, _ = pairs
    r = generate(cut, ids_for(tok, "hello"), parse_arm("0"), 20)
    assert r.proposed == 0 and r.draft_s == 0.0 and r.acceptance is None


def test_max_tokens_is_exact(pairs):
    tok, _, selfdraft = pairs
    ids = ids_for(tok, PROMPTS[0])
    for n in (1, 2, 5, 9):
        r = generate(selfdraft, ids, parse_arm("draft:8"), n)
        assert r.output_tokens <= n
        if r.finish_reason == "length":
            assert r.output_tokens == n


def test_arms_without_their_model_are_refused(tiny_models):
    tok, target, _ = tiny_models
    batch = RowBatch(Models(target, None, [tok.eos_token_id]))
    with pytest.raises(ValueError, match="needs a draft"):
        batch.check([1, 2], 5, parse_arm("draft:2"))
    with pytest.raises(ValueError, match="needs an EAGLE-3 head"):
        batch.check([1, 2], 5, parse_arm("eagle:2"))
    batch.check([1, 2], 5, parse_arm("ngram:2"))  # prompt lookup needs no model
    plain_draft = RowBatch(Models(target, tiny_models[2], [tok.eos_token_id]))
    with pytest.raises(ValueError, match="parallel drafting"):
        plain_draft.check([1, 2], 5, parse_arm("pard:2"))


@pytest.mark.parametrize("value", [-1, 10**9, "5", True])
def test_a_mask_id_outside_the_drafts_vocabulary_is_refused(tiny_models, value):
    tok, target, draft = tiny_models
    bad = copy.deepcopy(draft)
    bad.config.pard_token = value
    with pytest.raises(ValueError, match="pard_token"):
        Models(target, bad, [tok.eos_token_id])
    bad.config.pard_token = None
    bad.config.ptd_token_id = 7  # vLLM's other key
    assert Models(target, bad, [tok.eos_token_id]).parallel_token == 7


def test_chosen_linears_match_plain_linear_and_leave_training_alone():
    """Whatever form the probe picks per bucket of rows, a layer computes what F.linear does;
    with grad enabled (training) the plain path runs and gradients flow."""
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
def test_ngram_guesses_only_where_it_found_a_match_and_counts_add_up(pairs, tiny_models, k):
    tok, cut, _ = pairs
    plain = Models(tiny_models[1], None, [tok.eos_token_id])
    for text in [*PROMPTS, "def f(a): return a + a + a + a + a + a + a"]:
        ids = ids_for(tok, text)
        r = generate(plain, ids, parse_arm(f"ngram:{k}"), 32)
        assert r.token_ids == generate(cut, ids, parse_arm("0"), 32).token_ids
        assert r.arm == f"ngram:{k}" and r.draft_s == 0.0
        assert r.proposed == sum(r.proposed_per_position) <= k * r.rounds
        assert r.accepted == sum(r.accepted_per_position) <= r.proposed
        assert r.output_tokens <= r.rounds + r.accepted  # each step: accepted + one token
