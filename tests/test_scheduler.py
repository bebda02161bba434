"""The step loop (`speculative.scheduler`): rows of every arm in one batch, joining and leaving
mid-way, each row's output exactly its target-only greedy output."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.models import user_prompt_ids
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.engine import SpeculativeEngine
from pipeline.speculative.rows import RowCache, target_scores
from pipeline.speculative.scheduler import Cancelled, Job, StepCost, StepLoop

PROMPTS = [
    "Write a function to add two numbers.",
    "hello",
    "Sort a list of tuples by the second item, please.",
    "abc abc abc abc abc",
]
ARMS = ["0", "draft:1", "draft:2", "draft:4", "ngram:2", "ngram:4"]


@pytest.fixture(scope="module")
def engine(tiny_models):
    tok, target, draft = tiny_models
    return tok, SpeculativeEngine(target, draft, [tok.eos_token_id])


def reference(eng, ids, n):
    return eng.generate(ids, 0, n)


def test_rows_of_every_arm_joining_and_leaving_give_target_only_output(engine):
    """Requests of all arms and budgets arrive staggered (so rows join and leave mid-way) and
    share steps; every output equals target-only greedy decoding of that prompt alone."""
    tok, eng = engine
    loop = StepLoop(eng, max_rows=6)
    results: dict[int, tuple] = {}

    def run(i, ids, arm, n):
        results[i] = (ids, n, loop.submit(Job(ids, n, parse_arm(arm))))

    threads = []
    for i, (p, arm) in enumerate((p, a) for p in PROMPTS for a in ARMS):
        ids = user_prompt_ids(tok, p)
        n = 3 + (i * 7) % 25
        threads.append(threading.Thread(target=run, args=(i, ids, arm, n)))
        threads[-1].start()
        time.sleep(0.005 * (i % 3))
    for t in threads:
        t.join(timeout=120)
    assert len(results) == len(PROMPTS) * len(ARMS)
    assert loop.max_rows_seen == 6  # the batch was full at some point: rows shared steps
    for ids, n, res in results.values():
        ref = reference(eng, ids, n)
        assert (res.token_ids, res.finish_reason) == (ref.token_ids, ref.finish_reason), res.arm
        assert res.cost_s is not None and 0 < res.cost_s <= res.latency_s + 1e-6
    drafted = [r for _, _, r in results.values() if r.arm.startswith("draft")]
    assert sum(r.proposed for r in drafted) > 0  # the draft rows did draft


def test_a_row_that_ends_on_its_first_token_and_a_one_token_budget(engine):
    tok, eng = engine
    loop = StepLoop(eng, max_rows=4)
    ids = user_prompt_ids(tok, PROMPTS[0])
    first = reference(eng, ids, 1).token_ids[0]
    eos_eng = SpeculativeEngine(eng.target, eng.draft, [first])  # its first token is end-of-turn
    eos_loop = StepLoop(eos_eng, max_rows=4)
    res = eos_loop.submit(Job(ids, 10, parse_arm("draft:4")))
    assert res.token_ids == [] and res.finish_reason == "stop"
    one = loop.submit(Job(ids, 1, parse_arm("ngram:4")))
    assert one.token_ids == [first] and one.finish_reason == "length"


def test_cancel_before_joining_and_mid_way_and_on_tokens_stop(engine):
    tok, eng = engine
    loop = StepLoop(eng, max_rows=2)
    ids = user_prompt_ids(tok, PROMPTS[2])
    gone = threading.Event()
    gone.set()
    with pytest.raises(Cancelled):
        loop.submit(Job(ids, 8, parse_arm("draft:2"), cancel=gone))
    seen = []

    def stop_after_three(out):  # a stop string, as the serving layer decides it
        seen.append(len(out))
        return len(out) >= 3

    res = loop.submit(Job(ids, 30, parse_arm("0"), on_tokens=stop_after_three))
    assert res.finish_reason == "stop" and len(res.token_ids) == 3
    ref = reference(eng, ids, 3)
    assert res.token_ids == ref.token_ids
    assert loop.running == 0  # every path releases its row


def test_a_failing_step_fails_its_rows_and_the_loop_goes_on(engine, monkeypatch):
    tok, eng = engine
    loop = StepLoop(eng, max_rows=2)
    ids = user_prompt_ids(tok, PROMPTS[1])
    from pipeline.speculative import scheduler

    real = scheduler.target_scores
    calls = {"n": 0}

    def broken(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real(*a, **k)

    monkeypatch.setattr(scheduler, "target_scores", broken)
    with pytest.raises(RuntimeError, match="injected"):
        loop.submit(Job(ids, 5, parse_arm("0")))
    res = loop.submit(Job(ids, 5, parse_arm("ngram:2")))
    assert res.token_ids == reference(eng, ids, 5).token_ids


def test_requests_that_cannot_join_are_refused_alone(engine):
    tok, eng = engine
    plain = SpeculativeEngine(eng.target, None, [tok.eos_token_id])
    loop = StepLoop(plain, max_rows=2)
    with pytest.raises(ValueError, match="empty prompt"):
        loop.submit(Job([], 4, parse_arm("0")))
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit(Job([1, 2], 0, parse_arm("0")))
    with pytest.raises(ValueError, match="needs a draft"):
        loop.submit(Job([1, 2], 4, parse_arm("draft:2")))


def test_row_cache_rolls_back_one_row_without_touching_the_other(tiny_models):
    """Two rows verify feeds of different lengths; one keeps less than it fed. Its next scores
    equal those of a row that never saw the rejected tokens."""
    _, target, _ = tiny_models
    cache = RowCache(target, rows=3, limit=64, capacity=8)
    a, b = cache.alloc(), cache.alloc()
    seq_a, seq_b = [5, 6, 7, 8, 9], [11, 12]
    target_scores(target, cache, [a, b], [seq_a, seq_b], 0)
    target_scores(target, cache, [a, b], [[1, 2, 3, 4], [4]], 0)  # ragged, past the capacity of 8
    cache.crop(a, len(seq_a) + 1)  # row a keeps only token 1
    got = target_scores(target, cache, [a, b], [[2], [13]], 0)
    fresh = RowCache(target, rows=2, limit=64)
    c, d = fresh.alloc(), fresh.alloc()
    want = target_scores(target, fresh, [c, d], [[*seq_a, 1, 2], [*seq_b, 4, 13]], 0)
    assert got[0] == want[0][-1:] and got[1] == want[1][-1:]
    moved = cache.release(a)  # the last row moves into the freed slot, its prefix intact
    assert moved == b and cache.lengths[a] == len(seq_b) + 2
    again = target_scores(target, cache, [a], [[13]], 0)
    cache2 = RowCache(target, rows=1, limit=64)
    e = cache2.alloc()
    assert again[0] == target_scores(target, cache2, [e], [[*seq_b, 4, 13, 13]], 0)[0][-1:]
    assert cache.capacity > 8  # it grew past its first capacity, prefixes kept


def test_step_cost_shares_split_the_fixed_part_equally_and_tokens_by_row():
    cost = StepCost(a=1.0, b=0.0)
    assert cost.shares([1]) == [1.0]  # alone: the whole step
    assert cost.shares([1, 5]) == [0.5, 0.5]  # the prior: no per-token cost known yet
    for fed, secs in [(1, 0.05), (5, 0.09), (2, 0.06), (9, 0.13), (4, 0.08)]:
        cost.observe(fed, secs)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.04, rel=1e-6) and b == pytest.approx(0.01, rel=1e-6)
    plain, spec = cost.shares([1, 5])
    assert spec > plain and plain + spec == pytest.approx(1.0)
    assert plain == pytest.approx((0.02 + 0.01) / (0.04 + 0.06))
