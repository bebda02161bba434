import contextlib
import json
import random
import sys
import threading
import time

import pytest

from pipeline.speculative.bandit import EpsilonGreedy, load_bandit, save_bandit

ARMS = [0, 2, 4, 6, 8]


def make(seed=0, **kw):
    return EpsilonGreedy(ARMS, random.Random(seed), **kw)


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


def test_replay_of_measured_arms_scores_policies_like_the_bench():
    """benchmarks/bandit_replay.py: arm 0 is always twice as fast as any drafting arm."""
    import sys

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bandit_replay import replay

    arms = [0, 2, 4, 6, 8]
    table = {a: {i: (1.0 if a == 0 else 2.0, 10) for i in range(50)} for a in arms}
    # Rewards without noise: the plausible policy never explores a slower arm after warm-up.
    assert replay(table, arms, "plausible", seed=0) == (1.0, 1.0)
    uniform = [replay(table, arms, "uniform", seed=s) for s in range(10)]
    assert all(0.5 <= r < 1.0 and share < 1.0 for r, share in uniform)
    even = {a: {i: (1.0, 10) for i in range(50)} for a in arms}
    assert replay(even, arms, "uniform", seed=0)[0] == 1.0
