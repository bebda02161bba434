"""What the policy knows after the served draft changes: a new EAGLE-3 head's arms start over
(restarted or hot-swapped) and take the new head's bench prior, and a new draft's acceptance is
learnt under sustained load, within the bound `GoodputBandit.step_caps` states."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from pipeline import eagle3
from pipeline.config import load_config
from pipeline.models import Pair
from pipeline.serving.core import make_core
from pipeline.serving.request import Request, fixed
from pipeline.speculative.loaded import Models

EAGLE_ARMS = ["0", "draft:2", "eagle:2"]


@pytest.fixture(scope="module")
def head(tiny_models):
    _, target, _ = tiny_models
    torch.manual_seed(0)
    return eagle3.new_head(target, list(range(target.config.vocab_size)), None).eval()


def head_dir(tmp_path, name: str, content: bytes):
    """A directory whose weights file hashes to its own id (`artifacts.weights_id`)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(content)
    return str(folder)


def core_with_head(tiny_models, head, head_path, state_file, prior=None, arms=EAGLE_ARMS):
    tok, target, draft = tiny_models
    cfg = load_config(
        None,
        [f"bandit.arms={json.dumps(arms)}", "models.served_name=tiny", "bandit.fallback=false"],
    )
    engine = Models(target, draft, [tok.eos_token_id], head=head)
    pair = Pair(tok, engine, "tiny", "cut:1")
    info = {"spec": "cut:1", "head": head_path}
    return make_core(cfg, pair, "bandit", "cut:1", info, state_file, prior=prior, start=False)


def teach(core, arm: str) -> None:
    core.bandit.update(arm, 50.0, None, 0.8, 1.0, positions=(10, [10, 10], [8, 6]))
    core.policy._dirty = True  # as `Policy.reward` marks it: the state file is written at close


def test_a_restart_with_a_new_head_forgets_the_eagle_arms_and_takes_its_prior(
    tiny_models, head, tmp_path
):
    """The state file measured head one; the server restarts with head two beside the same
    draft model: the eagle arms start over and the new head's bench prior seeds them; the draft
    arms, whose weights did not change, keep theirs."""
    state = tmp_path / "bandit.json"
    one, two = head_dir(tmp_path, "one", b"head one"), head_dir(tmp_path, "two", b"head two")
    core = core_with_head(tiny_models, head, one, state)
    teach(core, "eagle:2")
    teach(core, "draft:2")
    core.close()
    prior = ({"eagle": ([10, 10], [10, 10], [2, 1])}, "the new head's bench")
    same = core_with_head(tiny_models, head, one, state, prior=prior)
    assert same.bandit.counts["eagle:2"] == 1 and same.policy.seeded == []  # nothing changed
    same.close()
    core = core_with_head(tiny_models, head, two, state, prior=prior)
    assert core.bandit.counts["eagle:2"] == 0
    assert core.policy.seeded == ["eagle"]  # the new head's prior, not the old head's figures
    assert core.bandit.guesses("eagle:2")[1] == pytest.approx((1.0, 1.2))  # 2 of 10 accepted
    assert core.bandit.counts["draft:2"] == 1  # the draft model did not change
    core.close()


def test_a_hot_swapped_head_forgets_the_eagle_arms(tiny_models, head, tmp_path):
    """A swap to a new draft model beside the same head keeps the eagle arms' figures; a swap
    to another head forgets them."""
    one, two = head_dir(tmp_path, "one", b"head one"), head_dir(tmp_path, "two", b"head two")
    core = core_with_head(tiny_models, head, one, tmp_path / "bandit.json")
    teach(core, "eagle:2")
    tok, target, draft = tiny_models
    core.scheduler.start()
    for name, beside in (("same head", one), ("new head", two)):
        engine = Models(target, draft, [tok.eos_token_id], head=head)
        core.swap_draft(Pair(tok, engine, "tiny", "cut:1"), name, {"spec": "x", "head": beside})
        assert core.bandit.counts["draft:2"] == 0  # a new draft model: as ever
        if beside == one:
            assert core.bandit.counts["eagle:2"] == 1 and "eagle:2" not in core.bandit.rewarm
    assert core.bandit.counts["eagle:2"] == 0 and core.bandit.guesses("eagle:2") is None
    assert "eagle:2" in core.bandit.rewarm
    core.close()


class Load:
    """Keeps `n` plain requests in flight on `core` (each one replaced as it ends), so the
    batch never falls to one row."""

    def __init__(self, core, ids, n: int = 4, tokens: int = 64):
        self.core, self.ids, self.tokens = core, ids, tokens
        self.stop = threading.Event()
        self.done: list[Request] = []
        for _ in range(n):
            self._submit()

    def _submit(self) -> None:
        if self.stop.is_set():
            return
        req = Request(self.ids, self.tokens, fixed("0"))
        req.future.add_done_callback(lambda _f: self._submit())
        self.done.append(req)
        self.core.submit(req)


def test_a_new_draft_is_measured_under_sustained_load_within_the_bound(tiny_models):
    """After a swap on a server kept at 4+ plain rows, the forgotten draft arm goes to the next
    bandit request, and its row guesses although its acceptance is unknown and other rows share
    its steps (capped at 0 it taught nothing, and beside other rows an arm of unknown
    acceptance is not chosen again: the new draft was never measured). Bound: the forgotten
    arms' warm-up pulls, here one request."""
    from tests.servers import tiny_core

    tok, target, draft = tiny_models
    core = tiny_core(tiny_models, arms=["0", "draft:2"], max_batch=8)
    ids = core.text_prompt_ids("def add(a, b):")
    for _ in range(2):  # warm-up alone: plain, then draft:2; every step cost measured
        core.generate(Request(ids, 16, core.mode("bandit")), timeout=60)
    assert core.bandit.guesses("draft:2") is not None
    load = Load(core, ids)
    try:
        new = Pair(tok, Models(target, draft, [tok.eos_token_id]), "tiny", "cut:1")
        core.swap_draft(new, "new", {"spec": "cut:1"})
        assert core.bandit.guesses("draft:2") is None and core.bandit.rewarm == ["draft:2"]
        out = core.generate(Request(ids, 24, core.mode("bandit")), timeout=60)
    finally:
        load.stop.set()
    for req in load.done:
        req.result(timeout=60)
    assert out.decision.arm == "draft:2" and out.rows >= 5  # joined 4 running rows
    assert out.result.batch_rows >= 4  # never alone
    assert out.result.proposed > 0  # the unknown row guessed
    measured = core.bandit.guesses("draft:2")
    assert measured is not None and len(measured) == 3  # both positions measured
    assert measured[1][1] > 1.0  # nonzero acceptance of the new draft
    core.close()
