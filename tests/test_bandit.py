import contextlib
import json
import random
import sys
import threading
import time
from dataclasses import replace

import pytest

from pipeline.serving.policy import load_bandit, save_bandit
from pipeline.speculative.bandit import EpsilonGreedy

ARMS = [0, 2, 4, 6, 8]


def make(seed=0, **kw):
    """The seed's policy: two warm-up pulls per arm, uniform exploration."""
    return EpsilonGreedy(
        ARMS, random.Random(seed), **{"warmup_pulls": 2, "explore": "uniform", **kw}
    )


def test_the_bandits_defaults_are_the_configs():
    """One set of defaults: EpsilonGreedy's own are the `bandit` section's."""
    import inspect

    from pipeline.config import BanditConfig

    b = BanditConfig()
    params = inspect.signature(EpsilonGreedy).parameters
    for name in ("warmup_pulls", "epsilon_start", "epsilon_floor", "epsilon_decay", "z"):
        assert params[name].default == getattr(b, name), name
    assert params["explore"].default == "plausible" and b.policy == "goodput"
    from pipeline.speculative.goodput import GoodputBandit

    assert inspect.signature(GoodputBandit).parameters["explore_margin"].default == (
        b.explore_margin
    )


def drive(b, rewards, n, noise_seed=1):
    rng = random.Random(noise_seed)
    out = []
    for _ in range(n):
        d = b.choose()
        out.append((d.arm, d.explored))
        b.update(d.arm, rewards[d.arm] + rng.random())
    return out


def test_warmup_tries_every_arm_twice_in_order():
    b = make()
    arms = [b.choose().arm for _ in range(10)]
    assert arms == ARMS * 2


def test_seeded_runs_make_the_same_choices():
    rewards = {0: 10, 2: 12, 4: 15, 6: 11, 8: 9}
    assert drive(make(3), rewards, 200) == drive(make(3), rewards, 200)
    assert drive(make(3), rewards, 200) != drive(make(4), rewards, 200)


def test_epsilon_schedule():
    b = make()
    for _ in range(10):
        b.choose()
    assert b.epsilon() == 0.3
    b.t = 10
    assert abs(b.epsilon() - 0.3 * 0.97**10) < 1e-12
    b.t = 1000
    assert b.epsilon() == 0.05


def test_incremental_mean_and_exploitation():
    b = make()
    for r in (1.0, 2.0, 6.0):
        b.update(4, r)
    assert b.counts[4] == 3 and abs(b.means[4] - 3.0) < 1e-12
    rewards = {0: 10, 2: 12, 4: 20, 6: 11, 8: 9}
    choices = drive(make(), rewards, 300)
    late = [a for a, explored in choices[-100:] if not explored]
    assert late and all(a == 4 for a in late)


def test_state_roundtrip_and_corrupt_file(tmp_path):
    b = make()
    drive(b, {a: a for a in ARMS}, 30)
    path = tmp_path / "bandit.json"
    save_bandit(b, path)
    c = make()
    assert load_bandit(c, path) == "restored"
    assert c.state() == b.state()
    path.write_text("{not json")
    fresh = make()
    assert load_bandit(fresh, path) == "corrupt"
    assert not path.exists() and list(tmp_path.glob("bandit.json.corrupt-*"))
    assert fresh.counts == {a: 0 for a in ARMS}
    path.write_text(json.dumps({**b.state(), "arms": [0, 1]}))
    assert load_bandit(make(), path) == "corrupt"


class SlowHashArm(int):
    """An arm id equal to its int, whose hashing runs Python code. On CPython with the GIL,
    update() on plain ints and floats runs no Python code inside its body, so the interpreter
    never switches threads there and a missing lock would go unnoticed. Every dict access with
    this key (each `counts[arm] += 1` reads and writes) is a point where the interpreter may
    switch, as free-threaded Python may anywhere."""

    def __hash__(self):
        return int.__hash__(self)


def hammer(bandit, threads=4, min_switches=300, limit_s=20.0):
    """Threads update arm 2 (thread i with reward i) until the interpreter has switched between
    them at least `min_switches` times; returns how many updates each thread made."""
    arm = SlowHashArm(2)
    calls = [0] * threads
    last, switches = [None], [0]  # racy on purpose: only a rough count of interleavings
    deadline = time.monotonic() + limit_s

    def work(i):
        while switches[0] < min_switches and time.monotonic() < deadline:
            if last[0] != i:
                last[0] = i
                switches[0] += 1
            bandit.update(arm, float(i))
            calls[i] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert switches[0] >= min_switches, "the threads hardly interleaved: nothing was tested"
    return calls


def test_concurrent_updates_lose_nothing():
    b = make()
    calls = hammer(b)
    n = sum(calls)
    mean = sum(i * c for i, c in enumerate(calls)) / n
    m2 = sum(c * (i - mean) ** 2 for i, c in enumerate(calls))
    assert b.counts == {0: 0, 2: n, 4: 0, 6: 0, 8: 0}
    assert b.means[2] == pytest.approx(mean, rel=1e-9)
    assert b.m2[2] == pytest.approx(m2, rel=1e-6)


def test_without_the_lock_the_race_is_observable():
    """The test above has teeth: with the lock replaced by a no-op, updates get lost."""
    b = make()
    b._lock = contextlib.nullcontext()
    calls = hammer(b)
    assert b.counts[2] < sum(calls)


def test_plausible_exploration_skips_clearly_worse_arms():
    rewards = {0: 20, 2: 5, 4: 4, 6: 3, 8: 2}  # arm 0 dominates by far more than the noise
    seed = make(explore="plausible")
    choices = drive(seed, rewards, 200)
    after = [a for a, _ in choices[10:]]
    assert after.count(0) == len(after)  # exploration never wastes a request on a hopeless arm
    plain = drive(make(), rewards, 200)
    assert [a for a, _ in plain[10:]].count(0) < len(after)  # the seed's uniform exploration does


def test_plausible_exploration_keeps_close_arms_in_play():
    b = make(explore="plausible")
    for _ in range(5):
        b.update(0, 10.0)
        b.update(2, 9.9)
        b.update(4, 1.0)
    b.update(2, 10.5)
    b.update(0, 9.0)
    assert set(b.candidates()) == {0, 2, 6, 8}  # 4 is hopeless; 6 and 8 are untried
    assert make(explore="uniform").candidates() == ARMS


def test_variance_survives_a_restart(tmp_path):
    b = make(explore="plausible")
    drive(b, {a: a for a in ARMS}, 40)
    save_bandit(b, tmp_path / "s.json")
    c = make(explore="plausible")
    load_bandit(c, tmp_path / "s.json")
    assert c.m2 == b.m2 and c.candidates() == b.candidates()


def _rec(lat, tokens=10, proposed=0, accepted=0, prompt_tokens=100):
    return {
        "latency_s": lat,
        "output_tokens": tokens,
        "proposed": proposed,
        "accepted": accepted,
        "prompt_tokens": prompt_tokens,
    }


def test_replay_of_measured_arms_scores_policies_like_the_bench():
    """The bandit replay (benchmarks/bandit_replay.py): arm 0 is always twice as fast as any
    drafting arm."""
    from benchmarks.bandit_replay import replay
    from pipeline.config import load_config
    from pipeline.serving.policy import make_bandit, make_guard

    b = load_config(None, ["bandit.warmup_pulls=1"]).bandit
    arms = ["0", "draft:2", "draft:4", "ngram:2", "ngram:4"]

    def walk(table, policy, seed=0):
        return replay(table, arms, make_bandit(b, arms, policy, seed), make_guard(b))

    table = {a: {i: _rec(1.0 if a == "0" else 2.0) for i in range(50)} for a in arms}
    # Rewards without noise: plausible and contextual never explore a slower arm after warm-up.
    for policy in ("plausible", "contextual"):
        r = walk(table, policy)
        assert (r["ratio"], r["best_share"], r["best_arm"], r["fallbacks"]) == (1.0, 1.0, "0", 0)
    seed = [walk(table, "seed", s) for s in range(10)]
    assert all(0.5 <= r["ratio"] < 1.0 and r["best_share"] < 1.0 for r in seed)
    even = {a: {i: _rec(1.0) for i in range(50)} for a in arms}
    assert walk(even, "seed")["ratio"] == 1.0


def test_contextual_policy_learns_a_different_best_arm_per_prompt_length():
    """Short prompts: ngram:4 is best; long prompts: arm 0. A context-free bandit must pick one
    arm for both; the contextual one learns each cell and beats it."""
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.contextual import ContextualBandit

    arms = ["0", "ngram:4"]

    def reward(arm, ctx):
        short = ctx.prompt_tokens < 128
        return 30.0 if (arm == "ngram:4") == short else 10.0

    def run(bandit, contextual):
        rng, got = random.Random(3), []
        for i in range(300):
            ctx = Context(prompt_tokens=50 if i % 2 else 400)
            d = bandit.choose(ctx if contextual else None)
            r = reward(d.arm, ctx) + rng.random()
            bandit.update(d.arm, r, ctx if contextual else None, 0.3 if d.arm != "0" else None)
            got.append(r)
        return sum(got[100:]) / 200

    ctx_mean = run(ContextualBandit(arms, random.Random(0), 1), True)
    flat_mean = run(EpsilonGreedy(arms, random.Random(0), 1, explore="plausible"), False)
    assert ctx_mean > 27 and flat_mean < 22
    b = ContextualBandit(arms, random.Random(0), 1)
    b.update("ngram:4", 30.0, Context(50), acceptance=0.5)
    assert b.recent_acceptance == {"ngram": 0.5}
    assert b.cell("ngram:4", Context(50, queue_depth=5)) == (0, 2, 2, 0)  # short, loaded, high
    assert b.cell("0", Context(600)) == (3, 0, -1, 0)  # arm 0 has no acceptance; greedy
    assert b.cell("0", Context(600, temperature=0.7))[-1] == 2  # sampled at 0.5-1


def test_contextual_state_round_trips(tmp_path):
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.contextual import ContextualBandit

    b = ContextualBandit(["0", "ngram:4"], random.Random(0), 1)
    for i in range(6):
        d = b.choose(Context(100 * i))
        b.update(d.arm, float(i), Context(100 * i), 0.2 if d.arm != "0" else None)
    save_bandit(b, tmp_path / "s.json")
    c = ContextualBandit(["0", "ngram:4"], random.Random(0), 1)
    assert load_bandit(c, tmp_path / "s.json") == "restored"
    assert c.cells == b.cells and c.recent_acceptance == b.recent_acceptance
    assert c.value("ngram:4", Context(300)) == b.value("ngram:4", Context(300))


def test_drift_guard_falls_back_cools_down_and_probes():
    from pipeline.speculative.guard import DriftGuard

    g = DriftGuard(window=4, margin=0.2, cooldown=2, min_samples=2)
    assert g.observe(True, False, 10.0) is None  # plain: 10 tokens/s
    for _ in range(3):
        assert g.observe(False, True, 20.0) is None  # drafting pays
    assert g.observe(False, False, 1.0) is None  # an explored arm is not what is served
    assert not g.hold()
    assert g.observe(False, True, 1.0) is None  # window 20, 20, 20, 1: still fine
    ev = g.observe(False, True, 1.0) or g.observe(False, True, 1.0) or g.observe(False, True, 1.0)
    assert ev["event"] == "fallback" and ev["plain_tps"] == 10.0 and ev["cooldown_requests"] == 2
    assert g.active and g.hold() and g.hold() and not g.hold()  # two plain requests, then probe
    assert [g.probe() for _ in range(3)] == [True, True, False]  # min_samples probes at most
    assert g.observe(False, True, 5.0) is None  # one probe sample: not judged yet
    ev = g.observe(False, True, 5.0)
    assert ev["event"] == "fallback" and ev["cooldown_requests"] == 4  # failed probe: doubled
    assert not g.probe()  # cooling down again
    assert g.hold() and g.hold() and g.hold() and g.hold() and not g.hold()
    assert g.probe()  # a new probe
    g.observe(False, True, 15.0)
    assert g.observe(False, True, 15.0)["event"] == "recovered"
    assert g.observe(False, True, 15.0) is None  # recovered once, then quiet


def test_latency_weighted_rewards_make_the_mean_tokens_over_time():
    """Weighted by latency, an arm's mean is its total tokens over its total time (the bench's
    figure), not the mean of per-request rates; the spread matches unit weights when equal."""
    b = EpsilonGreedy(["a"], random.Random(0))
    requests = [(10, 1.0), (30, 1.0), (20, 4.0)]  # (tokens, seconds)
    for tokens, secs in requests:
        b.update("a", tokens / secs, weight=secs)
    assert b.means["a"] == pytest.approx(60 / 6.0)  # not (10 + 30 + 5) / 3
    u, w = EpsilonGreedy(["a"], random.Random(0)), EpsilonGreedy(["a"], random.Random(0))
    for r in (3.0, 5.0, 10.0):
        u.update("a", r)
        w.update("a", r, weight=2.5)
    assert w.means == pytest.approx(u.means) and w._ss("a") == pytest.approx(u.m2["a"])
    with pytest.raises(ValueError, match="weight"):
        b.update("a", 1.0, weight=0)


@pytest.mark.parametrize("policy", ["plausible", "contextual", "goodput"])
def test_forgetting_the_draft_arms_keeps_the_rest_and_pulls_them_again(tmp_path, policy):
    """A new draft model: the draft arms start over (pulled again first), 0 and ngram keep
    what they learnt; the state file carries the pending re-pulls across a restart."""
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.contextual import ContextualBandit

    arms = ["0", "draft:2", "draft:4", "ngram:4"]
    from pipeline.speculative.goodput import GoodputBandit

    cls = {"contextual": ContextualBandit, "goodput": GoodputBandit}.get(policy, EpsilonGreedy)

    def make():
        return cls(arms, random.Random(0), 1)

    b = make()
    ctx = Context(prompt_tokens=50, queue_depth=0)
    for arm, reward in (("0", 10.0), ("draft:2", 30.0), ("draft:4", 20.0), ("ngram:4", 15.0)):
        b.choose(ctx)
        b.update(arm, reward, ctx, acceptance=0.5 if arm != "0" else None)
    b.forget(["draft:2", "draft:4"])
    assert b.counts == {"0": 1, "draft:2": 0, "draft:4": 0, "ngram:4": 1}
    assert b.means["ngram:4"] == 15.0 and b.means["draft:2"] == 0.0
    save_bandit(b, tmp_path / "s.json")
    restored = make()
    assert load_bandit(restored, tmp_path / "s.json") == "restored"
    picks = [restored.choose(ctx) for _ in range(2)]
    assert [d.arm for d in picks] == ["draft:2", "draft:4"] and all(d.warmup for d in picks)
    if policy == "contextual":
        assert "draft" not in b.recent_acceptance and "ngram" in b.recent_acceptance
        assert not [k for k in b.cells if k[0].startswith("draft")]


def goodput_bandit(arms=("0", "draft:2", "draft:4", "ngram:4"), **kw):
    from pipeline.speculative.goodput import GoodputBandit

    return GoodputBandit(
        list(arms), random.Random(0), 1, **{"epsilon_start": 0.0, "epsilon_floor": 0.0, **kw}
    )


def line(a: float, b: float) -> tuple[tuple[float, float], ...]:
    """The measured curve of a pass costing a + b * n, measured at every size the tests ask."""
    return tuple((float(n), a + b * n) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512))


def teach(b, arm, rounds, proposed, accepted):
    """One finished request of `arm`: `rounds` steps, these counts per position."""
    b.update(
        arm,
        1.0,
        None,
        sum(accepted) / max(1, sum(proposed)),
        positions=(rounds, proposed, accepted),
    )


def test_goodput_drafts_alone_and_stops_drafting_under_load():
    """One draft, one acceptance profile (learnt at one client); the step loop's costs say a
    row's share of a step is a / rows + b * tokens fed. Alone, the fixed cost dominates and
    draft:4 wins; at 16 rows every rejected guess costs a token's worth and plain wins. No
    exploration per load was needed: what one client taught holds at sixteen."""
    from pipeline.speculative.bandit import Context

    b = goodput_bandit()
    for _ in range(4):
        b.choose()  # the warm-up, one pull per arm
    teach(b, "draft:4", 10, [10, 10, 10, 10], [8, 6, 5, 4])  # P = .8, .6, .5, .4
    teach(b, "draft:2", 10, [10, 10], [8, 6])
    teach(b, "ngram:4", 10, [3, 3, 3, 3], [1, 1, 1, 0])  # few lookups hit
    step, draft = line(0.05, 0.004), line(0.01, 0.0005)  # a target pass; a draft pass
    alone = Context(rows=1, step_cost=step, draft_cost=draft)
    loaded = Context(rows=16, queue_depth=15, step_cost=step, draft_cost=draft, draft_rows=0)
    assert b.choose(alone).arm == "draft:4"
    assert b.choose(loaded).arm == "0"
    # The predictions are the formula's: draft:4 alone = (1 + 2.3) / (a + b * 5 + 4 * (ad + bd)).
    want = 3.3 / (0.05 + 0.004 * 5 + 4 * (0.01 + 0.0005))
    assert b.predict("draft:4", alone) == pytest.approx(want)
    assert b.predict("0", loaded) == pytest.approx(1 / (0.05 / 16 + 0.004))
    # A draft that stops being accepted is followed: the counts decay per round.
    for _ in range(40):
        teach(b, "draft:4", 10, [10, 10, 10, 10], [0, 0, 0, 0])
        teach(b, "draft:2", 10, [10, 10], [0, 0])
    assert b.choose(alone).arm in ("0", "ngram:4")


def test_goodput_reads_the_measured_curve_flat_for_a_few_tokens_then_steep():
    """A CPU pass: 1 to 5 tokens cost about the same, then every token costs its share (what
    one line through all steps gets wrong at both ends). Prompt lookup pays alone; at 16 rows,
    where its guesses would triple the tokens fed, plain wins."""
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.cost import step_seconds

    curve = ((1.0, 0.090), (5.0, 0.100), (16.0, 0.290))
    assert step_seconds(curve, 3) == pytest.approx(0.095)  # between points: linear
    assert step_seconds(curve, 0.5) == pytest.approx(0.090)  # below: the first's time
    assert step_seconds(curve, 27) == pytest.approx(0.290 * 27 / 16)  # past: proportional...
    steep = ((1.0, 0.090), (5.0, 0.100), (16.0, 0.400))
    assert step_seconds(steep, 27) == pytest.approx(0.400 + 11 * 0.3 / 11)  # ...or the slope
    # A loaded batch measured only its plain steps (16 tokens) past a flat stretch: 40 tokens
    # are priced at least in proportion, not at the flat slope (0.191 + 24 * 0.00325 = 0.269).
    flat = ((8.0, 0.165), (16.0, 0.191))
    assert step_seconds(flat, 40) == pytest.approx(0.191 * 40 / 16)
    assert step_seconds(((4.0, 0.2),), 8) == pytest.approx(0.4)  # one point: proportional
    with pytest.raises(ValueError, match="no measured points"):
        step_seconds((), 1)
    b = goodput_bandit(arms=("0", "ngram:2", "ngram:4"))
    for _ in range(3):
        b.choose()
    teach(b, "ngram:4", 10, [10, 10, 10, 10], [8, 6, 4, 3])
    teach(b, "ngram:2", 10, [10, 10], [8, 6])
    # Alone: ngram:4 commits 1 + .8 + .6 + .4 + .3 = 3.1 tokens a pass of 5 (0.1 s).
    assert b.choose(Context(rows=1, step_cost=curve)).arm == "ngram:4"
    assert b.choose(Context(rows=16, step_cost=curve)).arm == "0"
    # plain at 16 rows: 16 tokens per 0.29 s pass.
    assert b.predict("0", Context(rows=16, step_cost=curve)) == pytest.approx(16 / 0.29)


def test_goodput_prices_a_row_by_what_it_adds_to_the_batch():
    """The prediction is the batch's goodput with the row in it: the other rows' tokens fed and
    committed per step (the context's) plus the row's, over the whole step at that size and
    the draft passes it adds (the marginal draft pass when other rows draft already)."""
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.cost import step_seconds

    b = goodput_bandit()
    for _ in range(4):
        b.choose()
    teach(b, "draft:2", 10, [10, 10], [8, 6])  # tokens 2.4, fed 3
    teach(b, "ngram:4", 10, [5, 5, 5, 5], [4, 3, 2, 1])  # tokens 2.0, fed 3
    step = ((1.0, 0.09), (4.0, 0.10), (8.0, 0.14), (32.0, 0.38))
    draft = ((1.0, 0.010), (4.0, 0.016))
    ctx = Context(rows=6, step_cost=step, draft_cost=draft, draft_rows=2,
                  others_fed=9.0, others_tokens=7.5)  # fmt: skip
    s = lambda x: step_seconds(step, x)  # noqa: E731
    assert b.predict("0", ctx) == pytest.approx(8.5 / s(10))
    assert b.predict("ngram:4", ctx) == pytest.approx(9.5 / s(12))
    marginal = step_seconds(draft, 3) - step_seconds(draft, 2)
    assert b.predict("draft:2", ctx) == pytest.approx(9.9 / (s(12) + 2 * marginal))
    # Without the others' figures: rows - 1 plain rows.
    bare = Context(rows=6, step_cost=step, draft_cost=draft)
    assert b.predict("ngram:4", bare) == pytest.approx(7.0 / s(8))
    assert b.predict("draft:2", bare) == pytest.approx(7.4 / (s(8) + 2 * 0.010))
    # Alone this pass costs about a token's: prompt lookup pays; beside 15 plain rows its 2
    # extra tokens fed cost every row's step more than its one extra token gives the batch.
    assert b.predict("ngram:4", Context(rows=1, step_cost=step)) > b.predict(
        "0", Context(rows=1, step_cost=step)
    )
    loaded = Context(rows=16, step_cost=step)
    assert b.predict("ngram:4", loaded) < b.predict("0", loaded)


def test_the_step_gate_caps_the_bandit_rows_guesses_at_what_pays_at_this_batch():
    """`GoodputBandit.step_caps` and `Policy.may_guess` (the scheduler's per-step gate): alone
    a row guesses its k; beside one plain row, on a pass flat for a few tokens, all 4 pay;
    beside 15 plain rows its guesses cost more than they give the batch; 4 such rows on a pass
    flat to 8 tokens guess 1 each (the first guesses ride the flat pass, the later ones would
    not); a fixed arm keeps its k, and of the adaptive rows whose strategy has no acceptance
    yet (learners) the first guesses its k, the others sit out. Other policies cap nothing."""
    from pipeline.serving.policy import Policy
    from pipeline.speculative.arms import parse_arm
    from pipeline.speculative.batch import Row
    from pipeline.speculative.cost import step_seconds
    from pipeline.speculative.goodput import StepRow

    b = goodput_bandit(arms=("0", "ngram:4", "draft:2"))
    for _ in range(3):
        b.choose()
    teach(b, "ngram:4", 10, [10, 10, 10, 10], [6, 4, 2, 1])  # tokens 2.3, fed 5
    step = ((1.0, 0.09), (6.0, 0.10), (16.0, 0.25), (32.0, 0.50))
    guess, plain = StepRow("ngram:4", 4, True), StepRow("0", 0, True)
    assert b.step_caps([guess], step) == [4]
    assert b.step_caps([guess, plain], step) == [4, 0]
    assert b.step_caps([guess, *[plain] * 15], step) == [0] * 16
    assert b.step_caps([guess, *[plain] * 15], None) == [4] + [0] * 15  # no figures yet
    flat8 = ((1.0, 0.09), (8.0, 0.10), (16.0, 0.25), (32.0, 0.50))
    fixed, unknown = StepRow("ngram:4", 4, False, 5.0, 2.3), StepRow("draft:2", 2, True)
    assert b.step_caps([guess] * 4, flat8) == [1] * 4
    flat16 = ((1.0, 0.09), (16.0, 0.10), (32.0, 0.50))
    assert b.step_caps([guess, fixed, unknown], flat16) == [4, 4, 2]
    assert b.step_caps([guess, unknown, fixed, unknown], flat16) == [4, 2, 4, 0]
    spent = StepRow("ngram:4", 0, True, 5.0, 2.3)  # its budget's last token: guesses nothing
    assert b.step_caps([spent, guess], step) == [0, 4]  # priced as plain, not by its history
    assert b.step_values([spent, guess], step)[0] == b.step_values([plain, guess], step)[0]

    def row(arm: str, adaptive: bool, rounds=4, proposed=0, accepted=0) -> Row:
        r = Row(key=None, prompt=[1], max_tokens=8, arm=parse_arm(arm), epoch=0, start=0.0,
                tslot=0, adaptive=adaptive, rounds=rounds, proposed=proposed,
                accepted=accepted)  # fmt: skip
        r.k_eff = r.arm.k
        return r

    policy = Policy(b)
    assert policy.may_guess([row("ngram:4", True), row("0", True)], step, None) == [4, 0]
    full = [row("ngram:4", True), row("ngram:4", False), *[row("0", True) for _ in range(14)]]
    assert policy.may_guess(full, step, None) == [0, 4, *[0] * 14]
    assert policy.may_guess(full[:1], step, None) == [4]  # alone
    plausible = Policy(EpsilonGreedy(["0", "ngram:4"], random.Random(0)))
    assert plausible.may_guess(full, step, None) == [4, 4, *[0] * 14]
    # Prompt lookup guesses all its k or none: a row that guesses in half its steps is priced
    # half at 0 guesses, half at 4, not at the mean 2, where the pass has a knee.
    b.positions.clear()
    teach(b, "ngram:4", 10, [5, 5, 5, 5], [3, 2, 1, 0])
    knee = ((1.0, 0.09), (4.0, 0.10), (16.0, 0.25))
    values, _ = b.step_values([guess, StepRow("0", 0, False)], knee)
    exact = 0.5 * step_seconds(knee, 2) + 0.5 * step_seconds(knee, 6)
    assert values[4] == pytest.approx(2.6 / exact)
    assert values[4] < 2.6 / step_seconds(knee, 4)  # the mean feed's price


def test_an_arm_whose_request_left_its_acceptance_short_is_pulled_again():
    """A request that taught its arm nothing (capped out, or done before it could guess), or
    less than its k, puts the arm back on `rewarm`; once its k positions are measured, it is
    not pulled again (`GoodputBandit.step_caps`, learners)."""
    b = goodput_bandit(arms=("0", "draft:2", "draft:4"))
    for _ in range(3):
        b.choose()
    teach(b, "draft:4", 0, [0, 0, 0, 0], [0, 0, 0, 0])  # capped at 0 every step
    assert b.rewarm == ["draft:4"]
    b.rewarm.clear()
    teach(b, "draft:2", 10, [10, 10], [6, 4])  # draft:2 known; draft:4's positions 3, 4 not
    assert b.rewarm == [] and b.guesses("draft:4") is not None
    capped = ([5, 5, 0, 0], [5, 5, 0, 0], [3, 2, 0, 0])  # capped at 2: short of its k
    b.update("draft:4", 1.0, None, 0.5, positions=capped)
    assert b.rewarm == ["draft:4"]
    teach(b, "draft:4", 5, [5, 5, 5, 5], [3, 2, 1, 1])
    assert b.rewarm == ["draft:4"]  # once on the list; the next choice skips it as known
    assert len(b.guesses("draft:4")) == 5
    b.update("0", 1.0)  # plain: nothing to learn
    assert b.rewarm == ["draft:4"]


def test_the_step_gate_judges_the_rows_guessing_together():
    """Two EAGLE-3 rows share the head's passes (here a pass costs the same for one row as for
    two): both guessing pays (1.29x plain), where one guessing beside a plain row pays 4% at
    most (1 guess), under the 5% margin; a cap judged row by row beside rows that do not guess would never
    start."""
    from pipeline.speculative.goodput import StepRow

    b = goodput_bandit(arms=("0", "eagle:2"))
    for _ in range(2):
        b.choose()
    teach(b, "eagle:2", 10, [10, 10], [5, 3])  # tokens 1.8, fed 3
    step, head = ((1.0, 0.1), (6.0, 0.1), (16.0, 0.2)), ((1.0, 0.02), (2.0, 0.02))
    eagle = StepRow("eagle:2", 2, True)
    assert b.step_caps([eagle, eagle], step, None, head) == [2, 2]
    assert b.step_caps([eagle, StepRow("0", 0, True)], step, None, head) == [0, 0]


def test_goodput_explores_only_near_the_best_prediction():
    from pipeline.speculative.bandit import Context

    b = goodput_bandit(epsilon_start=1.0, epsilon_floor=1.0, explore_margin=0.3)
    for _ in range(4):
        b.choose()
    teach(b, "draft:4", 10, [10] * 4, [9, 8, 7, 6])
    teach(b, "draft:2", 10, [10] * 2, [9, 8])
    teach(b, "ngram:4", 10, [10] * 4, [0, 0, 0, 0])
    ctx = Context(rows=1, step_cost=line(0.05, 0.001), draft_cost=line(0.002, 0.0))
    picks = {b.choose(ctx).arm for _ in range(60)}
    assert picks <= {"draft:2", "draft:4"} and len(picks) == 2  # never 0 or ngram here


def test_goodput_beside_other_rows_a_near_tie_goes_to_plain():
    """Prompt lookup predicted 3% above plain at 8 rows: below speculate_margin (5%), so plain,
    and it is never explored there (epsilon 1); 10% above: it may run. Alone, a near-tie is
    the policy's to explore as before."""
    from pipeline.speculative.bandit import Context

    curve = ((1.0, 0.090), (5.0, 0.100), (8.0, 0.160), (16.0, 0.170))  # flat past 8 tokens
    b = goodput_bandit(arms=("0", "ngram:2"), epsilon_start=1.0, epsilon_floor=1.0,
                       explore_margin=0.5)  # fmt: skip
    for _ in range(2):
        b.choose()

    def with_gain(gain: float) -> Context:
        """Teach ngram:2 an acceptance that predicts `gain` x plain at 8 rows."""
        b.positions.clear()
        ctx = Context(rows=8, step_cost=curve)
        plain = b.predict("0", ctx)
        for hit in range(0, 1001):
            b.positions.clear()
            teach(b, "ngram:2", 1000, [1000, 0], [hit, 0])
            if b.predict("ngram:2", ctx) >= gain * plain:
                return ctx
        raise AssertionError("no acceptance reaches that gain")

    ctx = with_gain(1.03)
    assert {b.choose(ctx).arm for _ in range(40)} == {"0"}
    alone = Context(rows=1, step_cost=curve)
    assert {b.choose(alone).arm for _ in range(40)} == {"0", "ngram:2"}
    ctx = with_gain(1.10)
    assert "ngram:2" in {b.choose(ctx).arm for _ in range(40)}


def test_goodput_prices_a_step_per_number_of_guesses_not_at_the_mean_feed():
    """Prompt lookup guesses all its k or nothing: half its rounds feed 5 tokens, half 1 (a
    mean of 3). On a pass flat to 4 tokens and steep past them, its step is the mean of S(1)
    and S(5), not S(3) (priced at its mean feed it got 13 of 32 requests at 2 clients, where
    eagle:2 paid more).
    An arm that always guesses its k is priced at S(1 + k) either way."""
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.cost import step_seconds

    b = goodput_bandit(arms=("0", "ngram:4", "eagle:2"))
    for _ in range(3):
        b.choose()
    teach(b, "ngram:4", 10, [5, 5, 5, 5], [4, 3, 2, 1])  # 2 tokens a round on average
    teach(b, "eagle:2", 10, [10, 10], [6, 4])
    curve = ((1.0, 0.030), (4.0, 0.030), (8.0, 0.070))
    ctx = Context(rows=1, step_cost=curve)
    assert step_seconds(curve, 3) == pytest.approx(0.030)  # the mean feed: 3 tokens, flat
    mixed = (step_seconds(curve, 1) + step_seconds(curve, 5)) / 2
    assert b.predict("ngram:4", ctx) == pytest.approx(2.0 / mixed)  # 2 / 0.035, not 2 / 0.03
    assert b.predict("eagle:2", ctx) == pytest.approx(2.0 / step_seconds(curve, 3))


@pytest.mark.parametrize("per_row", [0.05, 0.0])
def test_goodput_the_margin_a_guess_must_beat_grows_with_the_rows(per_row):
    """A guess predicted 10% above plain: at 2 rows it passes the 5% margin, at 4 rows the
    margin is 15% (5% more a row past two) and the row is held back, and no speculative arm is
    chosen there; control: with no growth (`margin_per_row` 0) it guesses at 4 rows too."""
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.goodput import StepRow

    b = goodput_bandit(arms=("0", "ngram:2"), speculate_margin=0.05, margin_per_row=per_row)
    for _ in range(2):
        b.choose()
    curve = line(0.03, 0.001)

    def at(rows: int) -> Context:
        """Teach ngram:2 the acceptance that predicts 1.10-1.11x plain at `rows`."""
        ctx = Context(rows=rows, step_cost=curve)
        for hit in range(0, 1001):
            b.positions.clear()
            teach(b, "ngram:2", 1000, [1000, 0], [hit, 0])
            if b.predict("ngram:2", ctx) >= 1.10 * b.predict("0", ctx):
                assert b.predict("ngram:2", ctx) < 1.11 * b.predict("0", ctx)
                return ctx
        raise AssertionError("no acceptance reaches that gain")

    def guesses(rows: int) -> bool:
        """Whether the gate lets one ngram:2 row guess beside `rows` - 1 plain rows."""
        view = [StepRow("ngram:2", 2, True), *[StepRow("0", 0, False)] * (rows - 1)]
        return b.step_caps(view, curve)[0] > 0

    assert b.margin(2) == pytest.approx(0.05) and b.margin(1) == pytest.approx(0.05)
    at(2)
    assert guesses(2)
    assert b.choose(at(2)).arm == "ngram:2"
    four = at(4)
    assert b.margin(4) == pytest.approx(0.05 + 2 * per_row)
    assert guesses(4) is (per_row == 0)
    assert b.choose(four).arm == ("ngram:2" if per_row == 0 else "0")


def test_policy_saves_state_at_most_every_interval_on_its_clock(tmp_path):
    """The state file is written by the first reward after `save_every_s` of the injected
    clock, and by save(); fake time, no sleeps."""
    from pipeline.config import BanditConfig
    from pipeline.serving.policy import make_policy
    from pipeline.serving.request import CoreResult, fixed
    from pipeline.speculative.bandit import Context
    from pipeline.speculative.row import GenerationResult

    now = [100.0]
    state = tmp_path / "bandit.json"
    p = make_policy(BanditConfig(save_every_s=5.0), ["0", "ngram:2"], state, clock=lambda: now[0])

    def reward():
        d = p.choose(Context())
        res = GenerationResult([1, 2, 3], d.arm, "length", 0.3, 0.0, 0.3, 4, cost_s=0.3)
        p.reward(d, CoreResult("", "length", fixed("0"), res, d), Context())

    reward()
    assert not state.exists()  # within the interval: nothing written yet
    now[0] += 5.0
    reward()
    assert sum(json.loads(state.read_text())["counts"].values()) == 2
    reward()
    assert sum(json.loads(state.read_text())["counts"].values()) == 2  # throttled again
    p.save()
    assert sum(json.loads(state.read_text())["counts"].values()) == 3


def test_the_drift_guard_judges_goodput_relative_to_plain_at_its_load():
    """A speculative request at 8 rows earns less per request than a plain one alone did; what
    the guard compares is each figure over plain's predicted rate at that load."""
    from pipeline.config import BanditConfig
    from pipeline.serving.policy import plain_rate
    from pipeline.speculative.bandit import Context

    assert plain_rate(Context()) is None
    step = line(0.04, 0.01)
    assert plain_rate(Context(rows=1, step_cost=step)) == pytest.approx(1 / 0.05)
    assert plain_rate(Context(rows=8, step_cost=step)) == pytest.approx(1 / 0.015)
    assert BanditConfig().fallback  # on by default: the figure matters


def test_goodput_prices_an_eagle_head_by_its_own_guessing_cost():
    """eagle:K is charged what its head's K guesses cost (the batch's head curve), not the
    draft model's passes: with the same acceptance, a cheap head beats the draft model, and a
    head whose guessing costs a target pass per guess loses to plain."""
    from pipeline.speculative.bandit import Context

    b = goodput_bandit(arms=("0", "draft:4", "eagle:4"))
    for _ in range(3):
        b.choose()
    for arm in ("draft:4", "eagle:4"):
        teach(b, arm, 10, [10, 10, 10, 10], [7, 5, 4, 3])
    step, draft = line(0.05, 0.001), line(0.012, 0.0)
    cheap = Context(rows=1, step_cost=step, draft_cost=draft, head_cost=line(0.0, 0.002))
    dear = Context(rows=1, step_cost=step, draft_cost=draft, head_cost=line(0.0, 0.06))
    assert b.predict("eagle:4", cheap) == pytest.approx(2.9 / (0.05 + 0.001 * 5 + 4 * 0.002))
    assert b.choose(cheap).arm == "eagle:4"
    assert b.predict("eagle:4", dear) < b.predict("0", dear) < b.predict("draft:4", dear)


def test_a_bench_prior_skips_the_warm_up_of_the_arms_it_measured_once_their_costs_are_timed():
    """Seeded with the bench's acceptance per position, the goodput bandit's warm-up pulls only
    plain and the arms the prior does not cover, and only once the loop has timed a step as
    long as each arm feeds (and its draft pass): it then exploits the predicted best at once.
    Without the costs, or without the prior, every arm is pulled, as before."""
    from pipeline.speculative.bandit import Context

    prior = {"draft": ([100, 100, 100, 100], [100, 100, 100, 100], [80, 60, 50, 40])}
    step, draft = line(0.05, 0.004), line(0.01, 0.0005)
    timed = Context(rows=1, step_cost=step, draft_cost=draft)

    b = goodput_bandit()
    assert b.seed(prior, rounds=50) == ["draft"]
    assert b.positions["draft"][:4] == [50.0] * 4  # scaled to weigh 50 rounds
    assert b.positions["draft"][8:] == [40.0, 30.0, 25.0, 20.0]
    picks = [b.choose(timed) for _ in range(3)]
    # plain (the drift guard's comparison) and ngram:4 (unmeasured) warm up; both draft arms
    # are known, and draft:4 is the predicted best
    assert [(d.arm, d.warmup) for d in picks] == [
        ("0", True),
        ("ngram:4", True),
        ("draft:4", False),
    ]

    untimed = Context(rows=1, step_cost=((1.0, 0.05),), draft_cost=None)
    b = goodput_bandit()
    b.seed(prior, rounds=50)
    assert [b.choose(untimed).arm for _ in range(4)] == ["0", "draft:2", "draft:4", "ngram:4"]

    b = goodput_bandit()  # no prior: every arm in turn
    assert [b.choose(timed).arm for _ in range(4)] == ["0", "draft:2", "draft:4", "ngram:4"]

    b = goodput_bandit()  # figures already learnt (a restored state) are not overwritten
    teach(b, "draft:4", 10, [10, 10, 10, 10], [1, 1, 1, 1])
    assert b.seed(prior, rounds=50) == [] and b.positions["draft"][8] == 1.0
    assert b.seed({"eagle": ([5], [5], [4])}, rounds=50) == []  # no arm uses the head


def test_goodput_counts_the_other_rows_proposals_in_every_rows_step():
    """A row beside an EAGLE-3 row waits for that row's head each step whatever it runs, so
    plain beside it is dearer than its target pass alone. With the head's time in the step
    the second eagle:2 row pays (measured shape, AMD EPYC, 2 rows); priced at the target pass
    alone, the near-tie rule sends it to plain. `drafting_seconds` sums the rows' proposals:
    a head's time per eagle row, and one draft pass per position over the rows still guessing."""
    from types import SimpleNamespace

    from pipeline.speculative.bandit import Context
    from pipeline.speculative.cost import drafting_seconds

    b = goodput_bandit(arms=("0", "ngram:4", "eagle:2"))
    for _ in range(3):
        b.choose()
    teach(b, "eagle:2", 10, [10, 10], [5, 3])  # 1.8 tokens a step
    teach(b, "ngram:4", 10, [4, 4, 4, 4], [1, 1, 0, 0])
    step, head = line(0.028, 0.002), line(0.0, 0.0025)

    def row(k, rounds=0, proposed=0, eagle=False, draft=False):
        return SimpleNamespace(arm=SimpleNamespace(k=k, strategy="draft" if draft else "eagle"),
                               rounds=rounds, proposed=proposed,
                               guess_rounds=rounds, hcache=object() if eagle else None,
                               dslot=0 if draft else None)  # fmt: skip

    other = row(2, rounds=10, proposed=20, eagle=True)
    assert drafting_seconds([other], None, head) == pytest.approx(0.005)
    assert drafting_seconds([row(4), row(0)], None, head) == 0.0  # lookup and plain: free
    draft = line(0.010, 0.001)  # guesses 4 and 2: 2 passes over both rows, 2 over one
    two = [row(4, draft=True), row(2, rounds=5, proposed=10, draft=True)]
    assert drafting_seconds(two, draft, None) == pytest.approx(2 * 0.012 + 2 * 0.011)
    ctx = Context(rows=2, step_cost=step, head_cost=head, others_fed=3.0, others_tokens=1.8,
                  others_drafting=drafting_seconds([other], None, head))  # fmt: skip
    assert b.predict("0", ctx) == pytest.approx(2.8 / (0.028 + 0.002 * 4 + 0.005))
    assert b.predict("eagle:2", ctx) == pytest.approx(3.6 / (0.028 + 0.002 * 6 + 0.010))
    assert b.choose(ctx).arm == "eagle:2"
    blind = Context(rows=2, step_cost=step, head_cost=head, others_fed=3.0, others_tokens=1.8)
    assert b.choose(blind).arm == "0"  # the other row's head left out: a near-tie, plain


def test_an_eagle_row_pays_what_it_adds_to_the_shared_head_passes_its_read_included():
    """The head's passes are batched (a pass over two rows costs little more than over one),
    the rows' reads of their states included (one pass over them all, each row's first
    guess). So a guessing eagle row costs every row beside it its whole head, and an eagle row
    beside another eagle row adds the growth of the passes it shares: priced as an equal
    share of a mixed step, a guess beside a guessing row paid too much, and plain beside it
    too little. A row the gate holds back shares a pass only in the steps it guesses in."""
    from types import SimpleNamespace

    from pipeline.speculative.bandit import Context
    from pipeline.speculative.cost import added_passes, drafting_seconds, head_rows

    b = goodput_bandit(arms=("0", "eagle:4"))
    for _ in range(2):
        b.choose()
    teach(b, "eagle:4", 10, [10, 10, 10, 10], [6, 4, 3, 2])  # 2.5 tokens a step
    step = line(0.028, 0.002)
    head = ((1.0, 0.0032), (2.0, 0.0034), (4.0, 0.0036), (8.0, 0.0040))  # batched: flat-ish

    def eagle(k, rounds=0, proposed=0, guessed=None):
        return SimpleNamespace(arm=SimpleNamespace(k=k), rounds=rounds, proposed=proposed,
                               guess_rounds=rounds if guessed is None else guessed,
                               hcache=object(), dslot=None)  # fmt: skip

    one = eagle(4, rounds=10, proposed=30)  # 3 guesses a step: its read, then 2 passes
    assert drafting_seconds([one], None, head) == pytest.approx(3 * 0.0032)
    two = [one, eagle(2)]  # the reads and the second guesses over both, the third over one
    assert drafting_seconds(two, None, head) == pytest.approx(2 * 0.0034 + 0.0032)
    # Held back in 9 of 10 steps (the gate): one step's read and passes in ten, not every step.
    held = eagle(4, rounds=10, proposed=4, guessed=1)
    assert drafting_seconds([held], None, head) == pytest.approx(0.1 * 4 * 0.0032)
    # ... and it counts as a tenth of a row beside which another shares the passes.
    assert head_rows([one, held]) == pytest.approx(1.1)
    grown = 0.9 * (0.0034 - 0.0032) + 0.1 * (0.0035 - 0.0034)
    assert added_passes(head, 1.1, 2) == pytest.approx(2 * grown)
    assert added_passes(head, 0.5, 1) == pytest.approx(0.5 * 0.0032 + 0.5 * 0.0002)
    mixed = Context(rows=2, step_cost=step, head_cost=head, others_fed=4.0, others_tokens=2.5,
                    others_drafting=drafting_seconds([one], None, head))  # fmt: skip
    base = 0.028 + mixed.others_drafting
    assert b.predict("0", mixed) == pytest.approx(3.5 / (base + 0.002 * 5))
    guessing = replace(mixed, head_rows=1)  # 4 passes (the read first) grown from 1 row to 2
    own = 4 * 0.0002
    tokens = 2.5 + 1 + 0.6 + 0.4 + 0.3 + 0.2
    assert b.predict("eagle:4", guessing) == pytest.approx(
        tokens / (base + 0.002 * 9 + own)
    )  # fmt: skip
    alone = replace(mixed, head_rows=0, others_drafting=0.0)  # nobody else drafts: H(1) each
    assert b.predict("eagle:4", alone) == pytest.approx(tokens / (0.028 + 0.002 * 9 + 0.0128))


def test_a_request_that_plain_wins_beside_a_plain_row_gets_the_gated_guesser_if_it_pays_alone():
    """Beside a plain row a second guesser can lose to plain (a guess beside a plain row
    gained 3% at 2 clients, two guessing rows 1.12-1.20x; AMD EPYC, eagle:2), and a plain arm
    is for the request's life, so plain beside plain stayed plain. Where a speculative arm
    wins alone, the request gets the arm best alone, deferred to the step loop's gate (which
    caps its guesses at what pays at each step); where none wins alone (or the one-row curve
    is unknown), plain."""
    from pipeline.speculative.bandit import Context

    b = goodput_bandit(arms=("0", "ngram:4", "eagle:2"))
    for _ in range(3):
        b.choose()
    teach(b, "eagle:2", 10, [10, 10], [5, 3])  # 1.8 tokens a step
    teach(b, "ngram:4", 10, [4, 4, 4, 4], [1, 1, 0, 0])  # 1.2 tokens for 5 fed
    steep, flat, head = line(0.028, 0.02), line(0.028, 0.0005), line(0.0, 0.0025)
    beside = Context(rows=2, step_cost=steep, head_cost=head, others_fed=1.0, others_tokens=1.0)
    assert b.predict("eagle:2", beside) < b.predict("0", beside)  # plain wins at this load
    d = b.choose(replace(beside, alone_cost=flat))  # alone: eagle:2 52 tok/s, plain 35
    assert (d.arm, d.deferred, d.explored) == ("eagle:2", True, False)
    d = b.choose(replace(beside, alone_cost=steep))  # alone: eagle:2 19.4 tok/s, plain 20.8
    assert (d.arm, d.deferred) == ("0", False)
    assert (b.choose(beside).arm, b.choose(beside).deferred) == ("0", False)
    alone = b.choose(Context(rows=1, step_cost=flat, head_cost=head, alone_cost=flat))
    assert (alone.arm, alone.deferred) == ("eagle:2", False)  # chosen outright, not deferred
    # Beside 3 plain rows prompt lookup predicts best of the guessers (no head to wait for),
    # but the gate lets the row guess where the batch thins, where eagle:2 wins: that is the
    # strategy deferred to (prompt lookup, deferred at 4 clients, guessed at acceptance 0.18).
    curve, head = line(0.03, 0.0005), line(0.0, 0.005)
    crowded = Context(rows=4, step_cost=curve, head_cost=head, others_fed=3.0, others_tokens=3.0)
    v = {a: b.predict(a, crowded) for a in b.arms}
    assert v["eagle:2"] < v["ngram:4"] < 1.05 * v["0"]  # plain chosen, ngram:4 the best guesser
    d = b.choose(replace(crowded, alone_cost=curve))  # alone: eagle:2 43.4, ngram:4 38.3, 0 32.8
    assert (d.arm, d.deferred) == ("eagle:2", True)


@pytest.mark.parametrize("judged_at_its_run", [True, False])
def test_the_drift_guard_judges_a_request_at_the_load_it_ran_at(judged_at_its_run):
    """At 2 clients a request that arrives first joins alone, then runs beside the next: its
    goodput is a 2-row figure. Here the plain requests joined alone and the speculative ones
    beside a row, all ran at 2 rows, speculation 1.1x plain's goodput. Judged against plain
    at the load it joined, each plain request read about twice plain's rate and the guard fell
    back from speculation that paid (seen at 2 clients on the AMD EPYC); judged at its mean
    batch (`batch_rows`), nothing falls back. The control half: judged at the load joined."""
    from pipeline.config import BanditConfig
    from pipeline.serving.policy import make_policy
    from pipeline.serving.request import CoreResult, fixed
    from pipeline.speculative.bandit import Context, Decision
    from pipeline.speculative.row import GenerationResult

    p = make_policy(BanditConfig(policy="goodput"), ["0", "ngram:4"])
    step = line(0.028, 0.002)  # plain: 1 row 33.3 tok/s, 2 rows 62.5 tok/s a row
    events = []
    for i in range(8):
        arm = "0" if i % 2 else "ngram:4"
        rate = 62.5 * (1.0 if arm == "0" else 1.1)
        res = GenerationResult([1] * 48, arm, "length", 1.0, 0.0, 1.0, 100,
                               cost_s=48 / rate, batch_rows=2.0)  # fmt: skip
        d = Decision(arm, False, False, 0.0, {}, {})
        rows = 2 if judged_at_its_run else None
        joined = Context(rows=1 if arm == "0" else 2, step_cost=step)
        out = CoreResult("", "length", fixed(arm), res, d)
        events.append(p.reward(d, out, joined, step, rows))
    fell_back = any(e and e["event"] == "fallback" for e in events)
    assert fell_back is not judged_at_its_run


def test_without_a_plain_arm_a_choice_before_any_acceptance_is_known_does_not_fail():
    """`bandit.arms` need not include 0. Right after the warm-up, with those requests still
    running (no acceptance measured), nothing has a prediction: the measured means decide
    (it raised ValueError from max() of nothing, failing the request)."""
    from pipeline.speculative.bandit import Context

    b = goodput_bandit(arms=("ngram:4", "eagle:2"))
    assert [b.choose().arm for _ in range(2)] == ["ngram:4", "eagle:2"]  # warm-up
    crowded = Context(rows=3, step_cost=line(0.03, 0.0005), others_fed=2.0, others_tokens=2.0)
    for ctx in (crowded, Context(rows=1, step_cost=line(0.03, 0.0005))):
        d = b.choose(ctx)
        assert d.arm in ("ngram:4", "eagle:2") and not d.warmup
    teach(b, "eagle:2", 10, [10, 10], [5, 3])
    assert b.choose(Context(rows=1, step_cost=line(0.03, 0.0005))).arm == "eagle:2"


@pytest.mark.parametrize("policy", ["seed", "plausible", "contextual", "goodput"])
def test_every_configurable_policy_serves_bandit_requests(tiny_models, policy):
    """Each `bandit.policy` value builds a serving core whose bandit requests run and teach it
    (no policy is benchmark-only: the config accepts them all)."""
    from pipeline.serving.request import Request
    from tests.servers import tiny_core

    core = tiny_core(
        tiny_models, arms=["0", "draft:2", "ngram:2"], sets=(f"bandit.policy={policy}",)
    )
    ids = core.text_prompt_ids("def add(a, b):")
    for _ in range(3):
        out = core.generate(Request(ids, 6, core.mode("bandit")), timeout=60)
        assert out.decision is not None and len(out.result.token_ids) == 6
    assert sum(core.bandit.counts.values()) == 3
    core.close()
