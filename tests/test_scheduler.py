"""The step loop (`speculative.batch` + `serving.scheduler`): rows of every arm in one batch,
joining and leaving mid-way, each row's output exactly its target-only greedy output."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from pipeline import eagle3
from pipeline.models import user_prompt_ids
from pipeline.serving.request import Cancelled, Refused
from pipeline.serving.scheduler import Job, Scheduler, apart
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch
from pipeline.speculative.cost import StepCost, per_step
from pipeline.speculative.loaded import Models
from pipeline.speculative.rows import RowCache, target_scores
from tests.conftest import target_greedy

PROMPTS = [
    "Write a function to add two numbers.",
    "hello",
    "Sort a list of tuples by the second item, please.",
    "abc abc abc abc abc",
]
ARMS = ["0", "draft:1", "draft:2", "draft:4", "ngram:2", "ngram:4", "eagle:1", "eagle:3"]


@pytest.fixture(scope="module")
def engine(tiny_models):
    tok, target, draft = tiny_models
    torch.manual_seed(0)  # an EAGLE-3 head started from the target (eagle:K rows)
    head = eagle3.new_head(target, list(range(target.config.vocab_size)), None).eval()
    return tok, Models(target, draft, [tok.eos_token_id], head=head)


def reference(eng, ids, n):
    """Target-only greedy output, by transformers' `generate` (the oracle)."""
    out = target_greedy(eng.target, ids, n, min(eng.eos_token_ids))
    return types.SimpleNamespace(token_ids=out, finish_reason="length" if len(out) == n else "stop")


def StepLoop(eng, max_rows, lean=True):  # noqa: N802 - a scheduler over a fresh batch
    return Scheduler(RowBatch(eng, max_rows, lean=lean))


def submit(loop: Scheduler, ids, n, arm, **kw):
    """Run one job to its end (blocking): its result, or its error raised."""
    done = threading.Event()
    job = Job(ids, n, parse_arm(arm) if isinstance(arm, str) else arm, lambda _j: done.set(), **kw)
    loop.submit(job)
    assert done.wait(120)
    if job.error is not None:
        raise job.error
    return job.result


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_rows_of_every_arm_joining_and_leaving_give_target_only_output(engine, lean):
    """Requests of all arms and budgets arrive staggered (so rows join and leave mid-way) and
    share steps; every output equals target-only greedy decoding of that prompt alone
    (transformers' own `generate`), through the lean runner and through
    transformers' forward with the rows' attention."""
    tok, eng = engine
    loop = StepLoop(eng, max_rows=6, lean=lean)
    results: dict[int, tuple] = {}

    def run(i, ids, arm, n):
        results[i] = (ids, n, submit(loop, ids, n, arm))

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
    # Rows shared steps (how many at once depends on the machine's speed: 5 or 6 of 6 here).
    assert 3 <= loop.batch.max_rows_seen <= 6
    assert any(res.proposed for _, _, res in results.values() if res.arm.startswith("eagle"))
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
    eos_eng = Models(eng.target, eng.draft, [first])  # its first token is end-of-turn
    eos_loop = StepLoop(eos_eng, max_rows=4)
    res = submit(eos_loop, ids, 10, "draft:4")
    assert res.token_ids == [] and res.finish_reason == "stop"
    one = submit(loop, ids, 1, "ngram:4")
    assert one.token_ids == [first] and one.finish_reason == "length"


def test_cancel_before_joining_and_mid_way_and_on_tokens_stop(engine):
    tok, eng = engine
    loop = StepLoop(eng, max_rows=2)
    ids = user_prompt_ids(tok, PROMPTS[2])
    gone = threading.Event()
    gone.set()
    with pytest.raises(Cancelled):
        submit(loop, ids, 8, "draft:2", cancel=gone)
    seen = []

    def stop_after_three(out, _logprobs=None):  # a stop string, as the serving layer decides it
        seen.append(len(out))
        return len(out) >= 3

    res = submit(loop, ids, 30, "0", on_tokens=stop_after_three)
    assert res.finish_reason == "stop" and len(res.token_ids) == 3
    ref = reference(eng, ids, 3)
    assert res.token_ids == ref.token_ids
    assert loop.running == 0  # every path releases its row


def test_a_failing_step_fails_its_rows_and_the_loop_goes_on(engine, monkeypatch):
    tok, eng = engine
    loop = StepLoop(eng, max_rows=2)
    ids = user_prompt_ids(tok, PROMPTS[1])
    from pipeline.speculative import batch

    real = batch.target_logits
    calls = {"n": 0}

    def broken(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real(*a, **k)

    monkeypatch.setattr(batch, "target_logits", broken)
    with pytest.raises(RuntimeError, match="injected"):
        submit(loop, ids, 5, "0")
    res = submit(loop, ids, 5, "ngram:2")
    assert res.token_ids == reference(eng, ids, 5).token_ids


def test_a_failing_prefill_releases_its_joiners_and_raises_its_own_error(engine, monkeypatch):
    """A prefill that fails frees every joiner's slots, the draft rows' too (they had none in
    the draft's cache yet), and the batch serves the next rows exactly."""
    from pipeline.speculative import batch as batch_mod

    tok, eng = engine
    ids = user_prompt_ids(tok, PROMPTS[0])
    b = RowBatch(eng, max_rows=2)
    real = batch_mod.prefill

    def broken(*a, **k):
        raise RuntimeError("injected prefill failure")

    monkeypatch.setattr(batch_mod, "prefill", broken)
    with pytest.raises(RuntimeError, match="injected prefill"):
        b.join([(0, ids, 6, parse_arm("draft:2")), (1, ids, 6, parse_arm("eagle:1"))])
    assert b.rows == [] and b._cache().used == 0
    monkeypatch.setattr(batch_mod, "prefill", real)
    rows = b.join([(0, ids, 6, parse_arm("draft:2")), (1, ids, 6, parse_arm("0"))])
    while b.rows:
        b.step()
    assert all(r.out == reference(eng, ids, 6).token_ids for r in rows)


def test_a_loop_not_started_runs_on_the_callers_thread_until_started(engine):
    """One thread runs the models (`serving.scheduler`): made with `start=False`, the loop has
    no thread; its calls and, through `drain`, its steps run on the caller's thread, exactly,
    until `start()`; from then on both run on the loop's own thread. Stopped before it ever
    started, a waiting job hears `Cancelled`."""
    tok, eng = engine
    here = threading.get_ident()
    loop = Scheduler(RowBatch(eng, 2), start=False)
    stepped: list[int] = []
    step = loop.batch.step
    loop.batch.step = lambda *a, **k: (stepped.append(threading.get_ident()), step(*a, **k))[1]
    ids = user_prompt_ids(tok, PROMPTS[0])
    assert not loop.started and loop.call(lambda b: threading.get_ident()) == here
    done = []
    loop.submit(Job(ids, 6, parse_arm("ngram:2"), done.append))
    assert not done  # nothing runs it until the caller drains
    loop.drain()
    assert done[0].result.token_ids == reference(eng, ids, 6).token_ids
    assert set(stepped) == {here} and not loop.started
    loop.start()
    stepped.clear()
    try:
        there = loop.call(lambda b: threading.get_ident())
        assert loop.started and there != here
        assert submit(loop, ids, 6, "draft:2").token_ids == reference(eng, ids, 6).token_ids
        assert set(stepped) == {there}
        with pytest.raises(RuntimeError, match="own thread"):
            loop.drain()
    finally:
        loop.stop()
    idle = Scheduler(RowBatch(eng, 2), start=False)
    idle.submit(Job(ids, 4, parse_arm("0"), done.append))
    idle.stop()
    assert isinstance(done[-1].error, Cancelled)


def test_requests_that_arrive_during_a_prefill_join_before_the_step(engine):
    """A burst: the loop admits its first arrival, and while that prefill runs the rest
    arrive. They join before the first step (a second admission, once a turn), so the first
    row does not step alone while they wait; then the loop steps them together, and a job
    arriving during that second prefill waits for the next turn (it joins after that step).
    Outputs stay exact."""
    tok, eng = engine
    loop = Scheduler(RowBatch(eng, 4), start=False)
    ids = [user_prompt_ids(tok, p) for p in PROMPTS[:4]]
    done: list[Job] = []
    jobs = [Job(i, 5, parse_arm(a), done.append) for i, a in zip(ids, ["0", "ngram:2", "0", "0"],
                                                                  strict=True)]  # fmt: skip
    join, step = loop.batch.join, loop.batch.step
    events: list[tuple[str, int]] = []

    def joining(items):
        events.append(("join", len(items)))
        rows = join(items)
        if len(events) == 1:  # arriving during the first prefill
            loop.submit(jobs[1])
            loop.submit(jobs[2])
        elif len(events) == 2:  # during the second: the next turn's
            loop.submit(jobs[3])
        return rows

    def stepping(*a, **k):
        events.append(("step", len(loop.batch.rows)))
        return step(*a, **k)

    loop.batch.join, loop.batch.step = joining, stepping
    loop.submit(jobs[0])
    loop.drain()
    assert events[:4] == [("join", 1), ("join", 2), ("step", 3), ("join", 1)]
    for job, i in zip(jobs, ids, strict=True):
        assert job.result.token_ids == reference(eng, i, 5).token_ids


def test_apart_runs_on_a_thread_that_has_ended():
    """`apart`: torch work beside a running loop goes to a thread of its own that is gone when
    it returns (its OpenMP pool with it); its value comes back, its error is raised here."""
    seen: list[threading.Thread] = []

    def work():
        seen.append(threading.current_thread())
        return torch.ones(4).sum().item()

    assert apart(work) == 4.0
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def broken():
        raise ValueError("no such draft")

    with pytest.raises(ValueError, match="no such draft"):
        apart(broken)


def test_requests_that_cannot_join_are_refused_alone(engine):
    tok, eng = engine
    plain = Models(eng.target, None, [tok.eos_token_id])
    loop = StepLoop(plain, max_rows=2)
    with pytest.raises(Refused, match="empty prompt"):
        submit(loop, [], 4, "0")
    with pytest.raises(Refused, match="max_tokens"):
        submit(loop, [1, 2], 0, "0")
    with pytest.raises(Refused, match="needs a draft"):
        submit(loop, [1, 2], 4, "draft:2")


def test_row_cache_rolls_back_one_row_without_touching_the_other(tiny_models):
    """Two rows verify feeds of different lengths; one keeps less than it fed. Its next scores
    equal those of a row that never saw the rejected tokens."""
    _, target, _ = tiny_models
    cache = RowCache(target, rows=3, limit=64, capacity=8)
    a, b = cache.alloc(), cache.alloc()
    seq_a, seq_b = [5, 6, 7, 8, 9], [11, 12]
    target_scores(target, cache, [a, b], [seq_a, seq_b])
    target_scores(target, cache, [a, b], [[1, 2, 3, 4], [4]])  # ragged, past the capacity of 8
    cache.crop(a, len(seq_a) + 1)  # row a keeps only token 1
    got = target_scores(target, cache, [a, b], [[2], [13]])
    fresh = RowCache(target, rows=2, limit=64)
    c, d = fresh.alloc(), fresh.alloc()
    want = target_scores(target, fresh, [c, d], [[*seq_a, 1, 2], [*seq_b, 4, 13]])
    assert got[0] == want[0][-1:] and got[1] == want[1][-1:]
    moved = cache.release(a)  # the last row moves into the freed slot, its prefix intact
    assert moved == b and cache.lengths[a] == len(seq_b) + 2
    again = target_scores(target, cache, [a], [[13]])
    cache2 = RowCache(target, rows=1, limit=64)
    e = cache2.alloc()
    assert again[0] == target_scores(target, cache2, [e], [[*seq_b, 4, 13, 13]])[0][-1:]
    assert cache.capacity > 8  # it grew past its first capacity, prefixes kept


def test_rows_stay_in_slot_order_so_a_step_reads_the_cache_as_a_view(engine):
    """A row leaving from the middle moves the last row into its slot; the batch keeps its rows
    in slot order, so the next step's plan reads every layer's cache as a view (a permuted one
    copies each layer's keys and values out: 8-17% of a pass at 4-16 rows, Intel Xeon). The
    draft cache moves only its own rows, so its order can differ from the target's: the draft
    pass sorts its rows by draft slot."""
    tok, eng = engine
    ids = [user_prompt_ids(tok, p) for p in PROMPTS]
    b = RowBatch(eng, max_rows=4)
    rows = b.join([(i, ids[i], 20, parse_arm("draft:2")) for i in range(4)])
    b.step()
    b.leave(rows[1])
    assert [r.tslot for r in b.rows] == [0, 1, 2]
    b.step()
    assert b._cache()._plan.view == (0, 3)
    # Plain, draft, draft; the plain row leaves: the last row takes target slot 0 but keeps
    # draft slot 1, so in target order the drafting rows hold draft slots 1, 0.
    b = RowBatch(eng, max_rows=4)
    rows = b.join(
        [(i, ids[i], 20, parse_arm(a)) for i, a in enumerate(["0", "draft:2", "draft:2"])]
    )
    b.step()
    b.leave(rows[0])
    assert [r.dslot for r in b.rows] == [1, 0]
    b.step()
    assert b._cache()._plan.view == (0, 2) and b._proposers["draft"].cache._plan.view == (0, 2)


def test_step_cost_shares_split_the_fixed_part_equally_and_tokens_by_row():
    cost = StepCost(a=1.0, b=0.0)
    assert cost.shares([1]) == [1.0]  # alone: the whole step
    assert cost.shares([1, 5]) == [0.5, 0.5]  # the prior: no per-token cost known yet
    cost.observe(3, 0.07)
    assert cost.coefficients() == (0.07, 0.0)  # one size seen: its mean time, nothing per token
    for fed, secs in [(1, 0.05), (5, 0.09), (2, 0.06), (9, 0.13), (4, 0.08)]:
        cost.observe(fed, secs)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.04, rel=1e-6) and b == pytest.approx(0.01, rel=1e-6)
    plain, spec = cost.shares([1, 5])
    assert spec > plain and plain + spec == pytest.approx(1.0)
    assert plain == pytest.approx((0.02 + 0.01) / (0.04 + 0.06))


def test_step_cost_curve_is_the_mean_time_per_size_bucket():
    cost = StepCost()
    assert cost.curve() == ()
    for n, secs in [(1, 0.09), (1, 0.09), (5, 0.10), (16, 0.28), (17, 0.30)]:
        cost.observe(n, secs)
    (n1, s1), (n5, s5), (n16, s16) = cost.curve()  # 16 and 17 share a bucket
    assert (n1, s1) == pytest.approx((1, 0.09)) and (n5, s5) == pytest.approx((5, 0.10))
    assert 16 < n16 < 17 and 0.28 < s16 < 0.30  # weighted toward the later step
    for _ in range(60):  # the machine slows: each bucket follows its recent steps
        cost.observe(1, 0.2)
        cost.observe(5, 0.25)
    assert [s for _, s in cost.curve()[:2]] == pytest.approx([0.2, 0.25], rel=0.01)


def test_step_cost_per_row_count_prices_a_guess_by_the_load_it_was_measured_at():
    """The grid of `benchmarks/loop_arms.py --grid` (Intel Xeon, bf16, ms): tokens fed alone do
    not fix a step's time. At 16 rows one guessing row's 4 guesses cost 8.5 ms; the all-rows
    curve, whose 20-token bucket mixes 4 rows that all guessed with them, prices them lower.
    Per row count the curve has both; at a load not measured it borrows the all-rows curve's
    increments (optimistic: that load gets tried, then measured)."""
    from pipeline.speculative.cost import step_seconds

    cost = StepCost()
    for rows, fed, ms in [(1, 1, 26.4), (1, 5, 29.6), (4, 4, 29.1), (4, 20, 42.2),
                          (16, 16, 41.9), (16, 20, 50.4)]:  # fmt: skip
        for _ in range(3):
            cost.observe(fed, ms / 1000, rows)
    every, at16, at4 = cost.curve(), cost.curve(16), cost.curve(4)
    assert 1000 * (step_seconds(at16, 20) - step_seconds(at16, 16)) == pytest.approx(8.5)
    assert 1000 * (step_seconds(every, 20) - step_seconds(every, 16)) < 8.5 * 0.8  # mixed
    assert 1000 * step_seconds(at4, 8) == pytest.approx(29.1 + 13.1 * 4 / 16)
    # 8 rows never measured: the all-rows curve. 2 rows measured plain only: its own point,
    # then the all-rows curve's increments from there.
    assert cost.curve(8) == every
    cost.observe(2, 0.027, 2)
    at2, every = cost.curve(2), cost.curve()
    assert step_seconds(at2, 2) == pytest.approx(0.027)
    step = step_seconds(every, 5) - step_seconds(every, 2)
    assert step_seconds(at2, 5) == pytest.approx(0.027 + step)


def test_step_cost_below_what_a_row_count_measured_follows_the_all_rows_curve_down():
    """4 rows measured only guessing (12 tokens, 146 ms: AMD EPYC, AVX2, float32): their plain
    4-token step is priced in proportion to the all-rows curve from there (146 x 84 / 143 =
    86 ms), not held at 146 ms, which made plain look as dear as guessing."""
    from pipeline.speculative.cost import step_seconds

    cost = StepCost()
    for rows, fed, ms in [(2, 4, 84.0), (2, 12, 140.0), (4, 12, 146.0)]:
        for _ in range(3):
            cost.observe(fed, ms / 1000, rows)
    every, at4 = cost.curve(), cost.curve(4)
    ratio = step_seconds(every, 4) / step_seconds(every, 12)
    assert step_seconds(at4, 12) == pytest.approx(0.146)
    assert step_seconds(at4, 4) == pytest.approx(0.146 * ratio)
    assert step_seconds(at4, 4) < 0.146 * 0.7


def test_the_step_curve_never_prices_more_tokens_cheaper():
    """Measured at 2 rows on the AMD EPYC (ms): one slow step at 7 tokens between 6- and
    8-token points seen many times. A pass of more tokens never costs less, so adjacent
    points out of order are pooled, weighted by their steps: the lone point no longer sets a
    7th token at 20 ms and an 8th at -16 ms."""
    from pipeline.speculative.cost import step_seconds

    cost = StepCost()
    for fed, ms, times in [(2, 34.1, 8), (4, 37.2, 8), (6, 42.9, 8), (7, 62.8, 1), (8, 46.9, 6)]:
        for _ in range(times):
            cost.observe(fed, ms / 1000, 2)
    curve = cost.curve(2)
    assert [n for n, _ in curve] == pytest.approx([2, 4, 6, 7, 8])
    times = [s for _, s in curve]
    assert times == sorted(times)
    w7, w8 = 1.0, sum(StepCost.BUCKET_DECAY**i for i in range(6))
    pooled = (62.8 * w7 + 46.9 * w8) / (w7 + w8) / 1000
    assert times[3] == pytest.approx(pooled) and times[4] == pytest.approx(pooled)
    assert times[:3] == pytest.approx([0.0341, 0.0372, 0.0429])  # in order: as measured
    assert step_seconds(curve, 6.5) < step_seconds(curve, 7.5)


@pytest.mark.parametrize(
    "arm, timed",
    [("eagle:2", [0, 1, 1, 2, 2, 7, 8, 8]), ("draft:2", [0, 0, 1, 1, 2, 2, 7, 8, 8])],
)
def test_a_proposer_curve_prices_a_guess_without_catching_up_on_a_held_back_stretch(
    engine, arm, timed
):
    """`head_cost` and `draft_cost` are what a row's guesses add to a step. A row the gate held
    back reads every step it sat out on its next turn (a head row's first turn: its whole
    prompt's states; a draft row's prompt is read at join): that read is charged to the row but
    not timed into the curve (it put an eagle:2 row's head at 20 ms instead of 4 at 2 rows on
    the AMD EPYC, and the gate held back guesses that paid 1.2x). Both time each pass, and the
    later passes of such a turn are steady, and timed (an eagle row's second guess: step 0's
    and step 7's only pass timed)."""
    tok, eng = engine
    ids = user_prompt_ids(tok, PROMPTS[1])
    batch = RowBatch(eng, max_rows=2)
    (row,) = batch.join([("a", ids, 40, parse_arm(arm))])
    row.adaptive = True
    curve = batch.head_cost if arm.startswith("eagle") else batch.draft_cost
    seen = []
    observe = curve.observe
    curve.observe = lambda n, s, rows=None: (seen.append(batch.steps), observe(n, s))
    hold = lambda rows: [0] * len(rows)  # noqa: E731 - the gate holds every row back
    plan = [None, None, None, hold, hold, hold, hold, None, None]  # 3-6 sit out, 7 catches up
    charged = []
    for gate in plan:
        before = row.draft_s
        batch.step(gate=gate)
        charged.append(row.draft_s - before)
    assert seen == timed  # `batch.steps` during each timed pass
    assert all((c > 0) == (g is None) for c, g in zip(charged, plan, strict=True))
    assert row.out == reference(eng, ids, 40).token_ids[: len(row.out)]


def test_the_head_curve_times_each_pass_against_the_rows_in_it(engine):
    """Eagle rows draft together: their reads of their states are one pass over them all,
    then their later guesses share one head pass per position. `head_cost` times each pass
    against its rows, so the policy can price what a row adds to the passes beside another
    (not an equal share of the whole). Their first turn reads the whole prompt: untimed."""
    tok, eng = engine
    batch = RowBatch(eng, max_rows=2)
    batch.join([(i, user_prompt_ids(tok, PROMPTS[i]), 30, parse_arm("eagle:3")) for i in (0, 1)])
    seen = []
    observe = batch.head_cost.observe
    batch.head_cost.observe = lambda n, s, rows=None: (seen.append((batch.steps, n)), observe(n, s))
    for _ in range(3):
        batch.step()
    assert seen == [(0, 2), (0, 2)] + [(s, 2) for s in (1, 2) for _ in range(3)]
    assert [x for x, _ in batch.head_cost.curve()] == [2.0]  # every pass over both rows


def test_the_step_curve_times_the_whole_step_less_draft_passes_and_callbacks(engine):
    """The policy's curve is the step's time but its draft passes (priced apart) and the
    caller's per-token callbacks; the rows' charges sum to what was timed (no draft rows
    here); `per_step` is what the rows feed and commit per step, from their own counters."""
    tok, eng = engine
    batch = RowBatch(eng, 4)
    ids = user_prompt_ids(tok, PROMPTS[3])
    batch.join([(i, ids, 8, parse_arm(a)) for i, a in enumerate(["0", "ngram:2", "ngram:4"])])
    before = [r.cost_s for r in batch.rows]

    def slow(row) -> bool:
        time.sleep(0.1)
        return False

    t0 = time.perf_counter()
    batch.step(slow)
    wall = time.perf_counter() - t0
    ((n, secs),) = batch.cost.curve()
    assert n == sum(1 + r.proposed for r in batch.rows)  # one step: tokens fed
    assert wall > 0.3 and secs < wall - 0.3 + 1e-3  # the three callbacks' 0.3 s are not in it
    charged = sum(r.cost_s - b for r, b in zip(batch.rows, before, strict=True))
    assert charged == pytest.approx(secs, rel=1e-6)
    batch.step()
    fed, tokens = per_step(batch.rows)
    assert fed == pytest.approx(sum(1 + r.proposed / 2 for r in batch.rows))
    assert tokens == pytest.approx(sum(1 + r.accepted / 2 for r in batch.rows))
    fresh = batch.join([(9, ids, 8, parse_arm("ngram:4"))])
    assert per_step(fresh) == (5.0, 1.0)  # not stepped yet: k guesses, one token


@pytest.mark.parametrize("cap", [0, 1])
def test_the_gate_caps_adaptive_rows_only_and_outputs_stay_exact(engine, cap):
    """A gate that caps every row at `cap` guesses: the bandit's (adaptive) rows guess at most
    that many a step (0: they run as plain rows and count no guessing rounds), and count a
    position as one they could guess at only below the cap; a fixed arm's row guesses its k as
    before; every output is still its target-only output. The scheduler hands its gate to
    every step and marks a job's row adaptive as the job says."""
    tok, eng = engine
    ids = user_prompt_ids(tok, PROMPTS[3])
    want = reference(eng, ids, 12).token_ids
    asked = []

    def capped(rows):
        asked.append(len(rows))
        return [cap] * len(rows)

    loop = Scheduler(RowBatch(eng, 4), gate=capped)
    try:
        jobs = {}
        done = threading.Semaphore(0)
        for name, arm, adaptive in [("bandit-ngram", "ngram:4", True),
                                    ("bandit-draft", "draft:2", True),
                                    ("fixed-ngram", "ngram:4", False),
                                    ("bandit-plain", "0", True)]:  # fmt: skip
            jobs[name] = Job(ids, 12, parse_arm(arm), lambda _j: done.release(),
                             adaptive=adaptive)  # fmt: skip
        for job in jobs.values():
            loop.submit(job)
        for _ in jobs:
            assert done.acquire(timeout=120)
    finally:
        loop.stop()
    res = {name: job.result for name, job in jobs.items()}
    assert all(r.token_ids == want for r in res.values())
    assert asked and max(asked) >= 2
    for name in ("bandit-ngram", "bandit-draft"):
        r = res[name]
        assert sum(r.proposed_per_position[cap:]) == 0 and sum(r.eligible_per_position[cap:]) == 0
        if cap == 0:
            assert r.proposed == 0 and r.guess_rounds == 0
        else:  # it guessed in every step but the last (its budget's last token)
            assert r.eligible_per_position[0] == r.guess_rounds >= r.rounds - 1
    assert res["bandit-draft"].proposed == res["bandit-draft"].guess_rounds * cap
    fixed = res["fixed-ngram"]
    assert fixed.proposed > 0 and fixed.guess_rounds > 0
    assert fixed.eligible_per_position[0] == fixed.guess_rounds
    assert fixed.eligible_per_position[3] > 0  # its first step could guess 4


def test_a_qwen3_pair_runs_the_loop_exactly(model_cache):
    """The reference setup's architecture (q/k norms, tied embeddings), tiny: every arm through
    the lean runner equals target-only greedy decoding by transformers' forward."""
    from pipeline import models, specs

    t, d = specs.resolve_pair("tiny:arch=qwen3,layers=2,hidden=64,seed=1", "cut:1", model_cache)
    tok = models.load_tokenizer(t)
    eng = Models(
        models.load_model(t, "float32", "cpu"), models.load_model(d, "float32", "cpu"),
        [tok.eos_token_id],
    )  # fmt: skip
    loop = StepLoop(eng, max_rows=4)
    for p in PROMPTS[:2]:
        ids = user_prompt_ids(tok, p)
        ref = reference(eng, ids, 20)
        for arm in ("0", "draft:3", "ngram:2"):
            assert submit(loop, ids, 20, arm).token_ids == ref.token_ids, arm
    from pipeline.speculative.runner import LeanRunner

    assert LeanRunner.supports(eng.target) and eng.target._phoenix_runner is not None


def test_calibrating_times_each_arm_alone_so_a_seeded_bandit_skips_its_warm_up(tiny_models):
    """`ServingCore.calibrate` runs one short generation per arm (every K) and plain on the
    empty loop: afterwards the step curve has each arm's feed, the draft
    pass is timed, the batch is empty again, and a bandit seeded with the draft's acceptance
    pulls only plain and the unmeasured ngram:4 before it exploits. Uncalibrated,
    the same seeded bandit pulls the draft arms too (their costs unknown)."""
    from tests.servers import TINY_ARMS, tiny_core

    prior = {"draft": ([100] * 8, [100] * 8, [90, 80, 70, 60, 50, 40, 30, 20])}

    def first_choices(core, n):
        core.policy.bandit.seed(prior, 50)
        out = []
        for _ in range(n):
            d = core.policy.choose(core.context(8))
            out.append((d.arm, d.warmup))
        return out

    core = tiny_core(tiny_models)
    try:
        batch = core.scheduler.batch
        timed, join = [], batch.join
        batch.join = lambda reqs: (timed.extend(str(r[3]) for r in reqs), join(reqs))[1]
        core.calibrate(tokens=12)
        assert sorted(timed) == sorted(TINY_ARMS)  # every K: a head's price grows with it
        assert not batch.rows and batch.draft_cost.seen
        assert max(n for n, _ in batch.cost.curve(1)) >= 1 + 8  # draft:8 fed 9 tokens a step
        got = first_choices(core, 3)
        assert got[:2] == [("0", True), ("ngram:4", True)]
        assert not got[2][1], got  # exploiting: which arm wins is the machine's timing
    finally:
        core.scheduler.stop()

    core = tiny_core(tiny_models)
    try:
        core.scheduler.call(lambda b: b.calibrate([1, 2, 3], [parse_arm(0)], 4))  # plain only
        got = first_choices(core, 3)
        assert got == [("0", True), ("draft:2", True), ("draft:4", True)]
    finally:
        core.scheduler.stop()


def test_the_gate_is_asked_again_when_the_rows_change_else_every_few_steps(tiny_models):
    """`ServingCore._gate` reuses its caps while the same rows run (its judgement cost 1.5% of a
    compiled 16-row step to say "none" step after step) for at most `GATE_EVERY` steps, and
    judges again at once after a join or a leave; every output stays the target's own."""
    from pipeline.serving import core as serving
    from pipeline.serving.request import Request, fixed
    from tests.servers import tiny_core

    core = tiny_core(tiny_models, arms=["ngram:2"], max_batch=4)  # every bandit row adaptive
    try:
        batch = core.scheduler.batch
        prompts = [core.text_prompt_ids(t) for t in ("def add(a, b):", "x = [1, 2]", "for i")]
        plain = [core.generate(Request(p, 10 + 4 * i, fixed("0")), timeout=60).result.token_ids
                 for i, p in enumerate(prompts)]  # fmt: skip
        assert batch.cost.seen
        asked, real = [], core.policy.may_guess

        def may_guess(rows, *a):
            asked.append((batch.changes, batch.steps, len(rows)))
            return real(rows, *a)

        core.policy.may_guess = may_guess
        stepped, step = [], batch.step
        batch.step = lambda *a: (stepped.append((batch.changes, len(batch.rows))), step(*a))[1]
        reqs = [Request(p, 10 + 4 * i, core.mode("bandit")) for i, p in enumerate(prompts)]
        for r in reqs:
            core.submit(r)
        outs = [r.result(timeout=60).result.token_ids for r in reqs]
        assert outs == plain
    finally:
        core.scheduler.stop()
    gated = [s for s in stepped if s[1] > 1]  # alone, a row guesses its k: no gate
    assert len(asked) < len(gated)  # reused
    for (c0, s0, _), (c1, s1, _) in zip(asked, asked[1:], strict=False):
        assert c1 != c0 or s1 - s0 == serving.GATE_EVERY  # a change, or its time
    changes = {c for c, n in gated}
    assert changes <= {c for c, _, _ in asked}  # every set of rows was judged
