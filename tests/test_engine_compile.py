"""The compiled pass and the pruned draft head: same outputs, every shape compiled before
serving, clear failures. Compilation here uses torch.compile's eager backend (dynamo captures
graphs and guards exactly as with inductor, without generating code); `-m slow` runs inductor."""

import json
import os

import pytest
import requests
import torch

from pipeline import compiling, models
from pipeline.config import load_config
from pipeline.server import create_app
from pipeline.speculative.arms import parse_arm
from pipeline.speculative.batch import RowBatch, generate
from pipeline.speculative.loaded import Models
from pipeline.workspace import Workspace
from tests.conftest import target_greedy, wait_http
from tests.servers import ServerThread

from .test_engine import PROMPTS, ids_for

CHAT = "/v1/chat/completions"


def _reference(tiny_models, n=24):
    tok, target, _ = tiny_models
    return {t: target_greedy(target, ids_for(tok, t), n, tok.eos_token_id) for t in PROMPTS}


def _subset(tok, vocab):
    return [tok.eos_token_id, *range(0, vocab, 2)]  # every other id: many guesses impossible


def test_pruned_head_only_guesses_inside_its_subset_and_stays_exact(tiny_models):
    tok, target, draft = tiny_models
    subset = _subset(tok, draft.config.vocab_size)
    pruned = Models(target, draft, [tok.eos_token_id], draft_token_ids=subset)
    full = Models(target, draft, [tok.eos_token_id])
    allowed = set(subset)
    assert pruned.draft_head_ids == sorted(allowed)
    ref = _reference(tiny_models)
    guessed = {"pruned": set(), "full": set()}
    for name, models_ in (("pruned", pruned), ("full", full)):
        batch = RowBatch(models_, max_rows=len(PROMPTS))
        rows = batch.join([(t, ids_for(tok, t), 24, parse_arm("draft:3")) for t in PROMPTS])
        while batch.rows:
            batch.step()
            guessed[name].update(t for r in rows for t in r.drafts)
        assert all(r.out == ref[r.key] for r in rows)
    assert guessed["pruned"] and guessed["pruned"] <= allowed
    assert guessed["full"] - allowed  # the subset really constrains this draft


def test_the_limit_bounds_prompt_and_output(tiny_models):
    tok, target, draft = tiny_models
    ids = ids_for(tok, PROMPTS[0])
    batch = RowBatch(Models(target, draft, [tok.eos_token_id]), max_rows=1, limit=len(ids) + 7)
    r = generate(batch.models, ids, parse_arm("draft:4"), 500, batch=batch)
    assert r.finish_reason == "length" and len(ids) + r.output_tokens == len(ids) + 7


def test_token_counts_rank_then_fill_by_id():
    counts = [[3, 10], [7, 10], [9, 2]]  # as written: by count, then id
    assert models.top_tokens(counts, 3, 20, always=[1]) == [1, 3, 7]
    assert models.top_tokens(counts, 6, 20, always=[1]) == [1, 3, 7, 9, 0, 2]


def _ws_with_counts(tmp_path, counts):
    ws = Workspace(tmp_path / "art")
    ws.merged.mkdir(parents=True)
    (ws.merged / models.TOKEN_COUNTS).write_text(json.dumps({"tokens": 1, "counts": counts}))
    return ws


def test_draft_vocab_errors_name_the_key(tmp_path):
    from pipeline.errors import ConfigError

    cfg = load_config("configs/ci.yaml", ["engine.draft_vocab=300"])
    ws = _ws_with_counts(tmp_path, [[5, 1]])
    with pytest.raises(
        ConfigError, match=r"engine.draft_vocab=300 is larger than the vocabulary \(259"
    ):
        models.draft_token_ids(cfg, ws, str(tmp_path), 259, [0])
    cfg = load_config("configs/ci.yaml", ["engine.draft_vocab=16"])
    with pytest.raises(ConfigError, match="engine.draft_vocab=16 needs the token counts"):
        models.draft_token_ids(cfg, Workspace(tmp_path / "empty"), str(tmp_path), 259, [0])
    assert len(models.draft_token_ids(cfg, ws, str(tmp_path), 259, [0])) == 16


def test_bench_and_serve_refuse_draft_vocab_without_counts(cli, tmp_path, mbpp_path):
    art = str(tmp_path / "art")
    assert cli("split", "--config", "configs/ci.yaml", "--artifacts", art).returncode == 0
    res = cli(
        "bench", "--config", "configs/ci.yaml", "--artifacts", art,
        "--set", "engine.draft_vocab=64", "--draft", "base",
    )  # fmt: skip
    assert res.returncode == 2
    assert "engine.draft_vocab=64 needs the token counts" in res.log
    # A named draft without counts: exit 2 at once, not a server that loads and then answers
    # 503. (The base draft, untrained, is served over its full vocabulary with a warning.)
    named = tmp_path / "named-draft"
    named.mkdir()
    (named / "config.json").write_text('{"model_type": "llama"}')
    (named / "model.safetensors").write_bytes(b"0")
    res = cli(
        "serve", "--config", "configs/ci.yaml", "--artifacts", art,
        "--set", "engine.draft_vocab=64", "--set", f"server.draft={named}",
    )  # fmt: skip
    assert res.returncode == 2
    assert "engine.draft_vocab=64 needs the token counts" in res.log


def test_compile_auto_falls_back_with_one_warning_and_true_fails(tiny_pair, tmp_path, caplog):
    from pipeline.errors import PhoenixError

    ws = Workspace(tmp_path / "art")
    ws.models_cache.mkdir(parents=True)
    over = [f"models.target={tiny_pair[0]}", f"models.draft={tiny_pair[1]}"]
    bad = ["engine.backend=no_such_backend"]
    cfg = load_config("configs/ci.yaml", [*over, "engine.compile=auto", *bad])
    pair = models.load_pair(cfg, ws, cfg.models.draft)
    assert compiling.compile_engine(cfg, ws, pair) is False
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no_such_backend" in warnings[0].getMessage()
    assert not pair.target._phoenix_runner.compiled
    cfg = load_config("configs/ci.yaml", [*over, "engine.compile=true", *bad])
    pair = models.load_pair(cfg, ws, cfg.models.draft)
    with pytest.raises(PhoenixError, match="engine.compile=true: compiling failed"):
        compiling.compile_engine(cfg, ws, pair)


def test_the_compiled_loop_serves_every_arm_exactly_with_nothing_left_to_compile(
    tiny_pair, tmp_path, monkeypatch
):
    """engine.compile=true (dynamo's eager backend: the graphs and guards inductor would get):
    after the warm-up, rows of every arm (the EAGLE-3 head's too, its dense parts compiled),
    joining and leaving, compile nothing more and give target-only greedy output."""
    import threading

    from pipeline import eagle3
    from pipeline.serving.scheduler import Job, Scheduler

    ws = Workspace(tmp_path / "art")
    ws.models_cache.mkdir(parents=True)
    sets = [f"models.target={tiny_pair[0]}", f"models.draft={tiny_pair[1]}",
            "engine.compile=true", "engine.backend=eager"]  # fmt: skip
    cfg = load_config("configs/ci.yaml", sets)
    pair = models.load_pair(cfg, ws, cfg.models.draft)
    # torch's compile cache goes under the workspace unless the user chose one: importing
    # torch's compiler sets the variable to torch's /tmp default, which is not a choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    torch.manual_seed(0)
    vocab = list(range(pair.target.config.vocab_size))
    pair.models.head = eagle3.new_head(pair.target, vocab, None).eval()
    assert compiling.compile_engine(cfg, ws, pair) is True
    assert pair.models.head.compiled
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ws.compile_cache / "inductor")
    tok = pair.tokenizer
    eos = tok.eos_token_id
    texts = PROMPTS[:2]  # a short and a long prompt: rows of every arm join and leave
    refs = {t: target_greedy(pair.target, ids_for(tok, t), 16, eos) for t in texts}
    arms = ("0", "draft:2", "draft:4", "ngram:4", "eagle:1", "eagle:3")
    loop = Scheduler(RowBatch(pair.models, 4))
    done, results = threading.Semaphore(0), []

    def finished(job):
        results.append(job)
        done.release()

    runners = [m._phoenix_runner for m in (pair.target, pair.draft)]
    for r in runners:  # a pass the warm graph cannot take fails the request (serving: eager)
        r.stance = "fail_on_recompile"
    passes = [r.graph_passes for r in runners]
    graphs = dict(torch._dynamo.utils.counters["stats"])  # (counted: the patch is per thread)
    with torch._dynamo.config.patch(error_on_recompile=True):
        jobs = [Job(ids_for(tok, t), 16, parse_arm(a), finished, epoch=0) for t in texts
                for a in arms]  # fmt: skip
        for j in jobs:
            loop.submit(j)
        for _ in jobs:
            assert done.acquire(timeout=120)
    named = {id(j): t for j, t in zip(jobs, [t for t in texts for _ in arms], strict=True)}
    for j in results:
        assert j.error is None, j.error
        assert j.result.token_ids == refs[named[id(j)]], j.arm
    assert all(j.result.proposed for j in results if j.arm.strategy == "eagle")  # the head drafted
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs  # nothing compiled in a request
    # every step's target pass (and the draft's, drafting every row) went through the graph
    assert runners[0].graph_passes - passes[0] >= loop.batch.steps > 0
    assert runners[1].graph_passes > passes[1]
    loop.stop()
    for r in runners:
        r.stance = None


def test_the_compiled_pass_takes_every_pass_over_all_rows_padded_and_changes_nothing(
    tiny_models,
):
    """One compiled graph takes a pass over every row in slot order; where it has one row or
    one token a row, the spare slot joins it with two tokens (no size of 1: no new graph). A
    pass over some of the rows runs eager. The scores and the real rows' caches equal eager's,
    the cache grows under the graph, and the spare row is never advanced."""
    from pipeline.speculative.rows import RowCache, target_logits
    from pipeline.speculative.runner import prepare, warm_up

    _, target, _ = tiny_models
    prepare(target, 64)
    run = target._phoenix_runner

    def passes(cache):
        a = cache.alloc()
        out = [target_logits(target, cache, [a], [[5, 6, 7, 8]])]  # one row: padded
        out.append(target_logits(target, cache, [a], [[9]]))  # one row, one token: padded
        b = cache.alloc()
        out.append(target_logits(target, cache, [b], [[3, 4]]))  # some of the rows: eager
        out.append(target_logits(target, cache, [a, b], [[1], [2]]))  # one token a row: padded
        out.append(target_logits(target, cache, [a, b], [[1, 2, 3], [4]]))  # as it is
        kept = [k[s, :, : cache.lengths[s]].clone() for k in cache.keys for s in (a, b)]
        return out, kept, list(cache.lengths)

    eager = passes(RowCache(target, 2, 64, capacity=4))
    calls = []

    def counted(gm, example_inputs):  # dynamo's graph, run as it is, its calls counted
        def run_graph(*args):
            calls.append(1)
            return gm.forward(*args)

        return run_graph

    try:
        run.compile(backend=counted)
        warm_up(target)
        assert run.stance is None  # serving: cached graphs only, eager on a miss
        before, calls[:] = run.graph_passes, []
        cache = RowCache(target, 2, 64, capacity=4)
        compiled = passes(cache)
        assert run.graph_passes - before == 4
        assert len(calls) == 4  # each of them ran the warm graph (none fell back to eager)
    finally:
        run.uncompile()
    for got, want in zip(compiled[0], eager[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for got, want in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert compiled[2] == eager[2] == [9, 4, 0]  # the spare slot's length stays 0
    assert cache.capacity > 4 and cache.keys[0].shape[0] == 3  # grew; two rows and the spare


@pytest.mark.slow
def test_the_inductor_compiled_pass_serves_the_loop_exactly_from_one_graph(
    tiny_models, monkeypatch
):
    """`LeanRunner.compile` with inductor (frozen weights, max-autotune GEMMs on a CPU): rows of
    plain and n-gram arms joining and leaving give target-only greedy output, every step
    through the one warm graph (a pass it could not take would fail here). Dynamo traces the
    pass once (the norm epsilon traced as a symbol failed inductor's scalar pass, and dynamo
    restarted and compiled it again)."""
    import logging
    import threading

    import torch._dynamo.convert_frame as convert_frame

    from pipeline.serving.scheduler import Job, Scheduler
    from pipeline.speculative.runner import warm_up

    tok, target, _ = tiny_models
    refs = _reference(tiny_models, 20)
    batch = RowBatch(Models(target, None, [tok.eos_token_id]), 3)
    batch._cache()  # the runner for the loop's context (`prepare`)
    run = target._phoenix_runner
    restarts = []

    class Restarts(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Restarting analysis"):
                restarts.append(record.getMessage())

    handler = Restarts(logging.INFO)
    monkeypatch.setattr(convert_frame.log, "level", logging.INFO)
    convert_frame.log.addHandler(handler)
    try:
        run.compile()
        warm_up(target)
        assert restarts == []
        run.stance, before = "fail_on_recompile", run.graph_passes
        loop, done = Scheduler(batch), threading.Semaphore(0)
        jobs = [Job(ids_for(tok, t), 20, parse_arm(a), lambda job: done.release(), epoch=0)
                for t in PROMPTS for a in ("0", "ngram:3")]  # fmt: skip
        for j in jobs:
            loop.submit(j)
        for _ in jobs:
            assert done.acquire(timeout=300)
        loop.stop()
    finally:
        convert_frame.log.removeHandler(handler)
        run.uncompile()
        run.stance = None
    texts = [t for t in PROMPTS for _ in range(2)]
    for j, t in zip(jobs, texts, strict=True):
        assert j.error is None and j.result.token_ids == refs[t], j.arm
    assert run.graph_passes - before >= loop.batch.steps > 0


def test_compiled_server_warms_before_health_and_bounds_context(tmp_path, monkeypatch):
    """engine.compile on (the eager backend: dynamo graphs and guards, no codegen), a 64-token
    context, target only: /health turns 200 only once the loop's steps are compiled and warm,
    a streamed request says what a plain one says (the same loop), and a request longer than
    the context gets a 400 that names the limit. (Every arm compiled:
    tests/test_engine_compile.py.)"""
    from pipeline.config import load_config
    from pipeline.serving.core import build_core
    from pipeline.workspace import Workspace

    sets = ["engine.compile=true", "engine.backend=eager", "engine.max_context=64"]
    cfg = load_config("configs/ci.yaml", sets)
    cores = []

    def load():
        cores.append(build_core(cfg, Workspace(tmp_path / "art"), None, "target"))
        return cores[0]

    with ServerThread(create_app(load)) as s:
        wait_http(s.url + "/health", timeout=120)
        assert cores[0].compiled and cores[0].max_context == 64

        def ask(max_tokens=12, **extra):
            body = {"model": cfg.models.target, "messages": [{"role": "user", "content": "def"}],
                    "max_tokens": max_tokens, **extra}  # fmt: skip
            return requests.post(s.url + CHAT, json=body, timeout=60)

        plain = ask().json()["choices"][0]["message"]["content"]
        r = ask(stream=True)
        events = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")][:-1]
        chunks = [json.loads(e)["choices"] for e in events]
        assert "".join(c[0]["delta"].get("content", "") for c in chunks if c) == plain
        r = ask(max_tokens=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert "64 tokens" in err["message"] and "engine.max_context" in err["message"]
        assert ask().status_code == 200  # and it keeps serving
