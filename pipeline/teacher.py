"""Distillation: the target (the teacher) answers every training prompt.

    python -m pipeline distill --config configs/default.yaml     (or: make distill)

Reads <artifacts>/data/train.jsonl, writes <artifacts>/teacher/answers.jsonl (appended durably
per answer, resumable) and summary.json. The teacher is any OpenAI-compatible `teacher.url`, or
`local`: Phoenix's own server in target-only mode as a child process (`local_teacher`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .config import Config, dump_config
from .data import messages_of
from .errors import InputError, PhoenixError
from .subprocs import PREEXEC, free_port, stop
from .teacher_client import Answer, RetryBudget, TeacherClient
from .workspace import Workspace, atomic_write_json, atomic_write_text, read_jsonl

log = logging.getLogger(__name__)


class TeacherLogprobsMissing(PhoenixError):
    """kd asked the teacher for logprobs and it returned none (or ones that do not fit)."""

    exit_code = 2


# --- the local teacher -------------------------------------------------------------------------
def serve_command(config, artifacts, port: int, mode: str, extra: list[str] = ()) -> list[str]:
    """`python -m pipeline serve` on 127.0.0.1:port (the local teacher, the engine benchmark)."""
    return [
        *(sys.executable, "-m", "pipeline", "serve", "--config", str(config)),
        *("--artifacts", str(artifacts), "--host", "127.0.0.1", "--port", str(port)),
        *("--mode", mode, *extra),
    ]


def _target_tokenizer(cfg: Config, ws: Workspace):
    from . import models, specs  # torch and transformers: only when needed

    return models.load_tokenizer(specs.resolve(cfg.models.target, ws.models_cache))


def first_request(p: dict, turns: dict[int, list[int]], mode: str) -> list[dict]:
    return history(messages_of(p), turns[p["task_id"]][0], [], mode)


def local_context(cfg: Config, ws: Workspace, jobs: list[dict], turns: dict) -> int:
    """Tokens of context the local teacher needs: the longest first request plus
    `teacher.max_tokens` (`data.max_context` where a conversation has later turns), or
    `engine.max_context` where that is longer."""
    from . import models

    tok = _target_tokenizer(cfg, ws)
    kwargs, mode = cfg.template_kwargs(), cfg.distill.turns
    longest = max(
        (len(models.chat_prompt_ids(tok, first_request(p, turns, mode), kwargs)) for p in jobs),
        default=0,
    )
    need = longest + cfg.teacher.max_tokens
    if any(len(turns[p["task_id"]]) > 1 for p in jobs):
        need = max(need, cfg.data.max_context)
    return max(cfg.engine.max_context, need)


def context_check(cfg: Config, ws: Workspace, jobs: list[dict]) -> Callable[[list], bool] | None:
    """For conversations (rows with `messages`): does a request's history plus
    `teacher.max_tokens` fit in `data.max_context`? None for plain prompts (not checked)."""
    if not any("messages" in p for p in jobs):
        return None
    from . import models

    try:
        tok = _target_tokenizer(cfg, ws)
    except Exception as exc:  # a remote teacher's target need not be loadable here
        log.warning("distill: conversations' lengths not checked against data.max_context: "
                    "the target's tokenizer did not load (%s: %s)", type(exc).__name__, exc)  # fmt: skip
        return None
    kwargs = cfg.template_kwargs()
    room = cfg.data.max_context - cfg.teacher.max_tokens
    return lambda messages: len(models.chat_prompt_ids(tok, messages, kwargs)) <= room


def local_teacher_config(cfg: Config, context: int | None = None) -> Config:
    """The local teacher's config: eager, the full head, no traffic capture, `context` tokens."""
    eager = cfg.engine.model_copy(
        update={"compile": "false", "draft_vocab": 0,
                "max_context": context or cfg.engine.max_context}
    )  # fmt: skip
    quiet = cfg.traffic.model_copy(update={"capture": False})
    return cfg.model_copy(update={"engine": eager, "traffic": quiet})


@contextlib.contextmanager
def local_teacher(cfg: Config, ws: Workspace, context: int | None = None) -> Iterator[str]:
    """`pipeline serve --mode target` on a free loopback port, for the block; yields its URL."""
    ws.teacher.mkdir(parents=True, exist_ok=True)
    cfg_file = ws.teacher / ".local-teacher.yaml"
    local = local_teacher_config(cfg, context)
    atomic_write_text(cfg_file, dump_config(local))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != cfg.server.api_key_env}
    log_path = ws.teacher / "local-teacher.log"
    cmd = serve_command(cfg_file, ws.root, port, "target", ["--cache", str(ws.cache)])
    log.info("starting the local teacher (target only, context %d tokens) on 127.0.0.1:%d; "
             "log: %s", local.engine.max_context, port, log_path)  # fmt: skip
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=PREEXEC
        )
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)
        log.info("local teacher stopped")


# --- the stage ---------------------------------------------------------------------------------
def answered_turns(messages: list[dict], turns: str) -> list[int]:
    """The user turns (numbered from 0) the teacher answers: every one, or the last."""
    n = sum(m["role"] == "user" for m in messages)
    return list(range(n)) if turns == "all" else [n - 1]


def history(messages: list[dict], turn: int, answers: list[str], turns: str) -> list[dict]:
    """The messages sent to answer user turn `turn`. all: system and user messages up to it in
    place, each earlier user turn followed by the teacher's own answer to it (`answers[s]`; the
    file's assistant turns dropped); last: the file's messages up to it, as given."""
    out: list[dict] = []
    seen = -1
    for m in messages:
        if m["role"] == "user":
            if seen >= 0 and turns == "all":
                out.append({"role": "assistant", "content": answers[seen]})
            seen += 1
        elif m["role"] == "assistant" and turns == "all":
            continue
        out.append({"role": m["role"], "content": m["content"]})
        if seen == turn:
            return out
    raise ValueError(f"no user turn {turn}")


def load_answers(path: Path) -> dict[int, dict]:
    """The main answers (sample 0) to the first user turn already written, by task_id."""
    return {tid: row for (tid, t, j), row in load_all_answers(path).items() if t == j == 0}


def load_all_answers(path: Path) -> dict[tuple[int, int, int], dict]:
    """Every row by (task_id, turn, sample) (sample 0: the main answer; absent `turn` or
    `sample`: 0): the first of each, or the first with logprobs. A torn last line is cut off."""
    if not path.exists():
        return {}
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    if cut < len(raw):
        log.warning(
            "%s: dropping a torn last line (%d bytes) from an interrupted run", path, len(raw) - cut
        )
        with open(path, "r+b") as f:
            f.truncate(cut)
    rows: dict[tuple[int, int, int], dict] = {}
    for n, line in enumerate(raw[:cut].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (int(row["task_id"]), int(row.get("turn", 0)), int(row.get("sample", 0)))
            if key not in rows or ("completion_logprobs" in row) > (
                "completion_logprobs" in rows[key]
            ):
                rows[key] = row
        except (ValueError, KeyError, TypeError):
            raise InputError(
                f"{path}:{n}: not a valid answer row; move the file aside to start over"
            ) from None
    return rows


def append_line(path: Path, line: str) -> None:
    """Append one whole line durably (fsync); on failure the file is cut back: no torn row."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        data = memoryview(line.encode("utf-8"))
        try:
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def run(cfg: Config, ws: Workspace) -> dict[str, Any]:
    if not ws.train_file.exists():
        raise InputError(f"{ws.train_file} is missing: run the split stage first (make split)")
    prompts = read_jsonl(ws.train_file)
    if cfg.distill.limit is not None:
        prompts = prompts[: cfg.distill.limit]
    n_logprobs = cfg.requested_logprobs()
    n_extra = cfg.distill.extra_samples
    done = load_all_answers(ws.answers_file)  # (task_id, turn, sample) -> row
    if n_logprobs:  # answers written without logprobs (an sft run) are asked again
        done = {k: r for k, r in done.items() if "completion_logprobs" in r}
    turns = {p["task_id"]: answered_turns(messages_of(p), cfg.distill.turns) for p in prompts}
    planned = [(p["task_id"], t, j) for p in prompts for t in turns[p["task_id"]]
               for j in range(n_extra + 1)]  # fmt: skip
    todo = [k for k in planned if k not in done]
    todo_ids = {k[0] for k in todo}
    jobs = [p for p in prompts if p["task_id"] in todo_ids]
    log.info(
        "distill: %d prompts (up to %d turns answered each), %d answers already written, "
        "%d answers to go (%d extra samples each)",
        len(prompts), max(map(len, turns.values()), default=0),
        len(planned) - len(todo), len(todo), n_extra,
    )  # fmt: skip
    model = cfg.teacher.model or cfg.models.served_name or cfg.models.target
    stats: dict[str, Any] = {"retries": 0, "tokens": 0, "answers": 0, "dropped": set()}
    t_start = time.perf_counter()
    local = cfg.teacher.url == "local"
    concurrency = max(cfg.teacher.concurrency, cfg.server.max_batch if local else 1)  # fill it
    fits = context_check(cfg, ws, jobs) if jobs else None
    if jobs:
        jobs = [p for p in jobs if _needs_teacher(cfg, p, turns, done, fits, stats["dropped"])]
    if jobs:
        args = (model, jobs, turns, done, stats, concurrency, fits)
        if local:
            with local_teacher(cfg, ws, local_context(cfg, ws, jobs, turns)) as url:
                _answer_all(cfg, ws, url, *args)
        else:
            _answer_all(cfg, ws, cfg.teacher.url, *args)
    dropped = stats["dropped"]
    if dropped:
        log.warning(
            "distill: %d turn(s) of %d conversation(s) dropped: their history plus "
            "teacher.max_tokens exceeds data.max_context=%d tokens",
            len(dropped), len({tid for tid, _ in dropped}), cfg.data.max_context,
        )  # fmt: skip
    elapsed = time.perf_counter() - t_start
    asked = stats["answers"] > 0 and elapsed > 0
    rows = load_all_answers(ws.answers_file)
    mine = [rows[k] for k in planned if k[2] == 0 and k in rows]
    missing = {k[0] for k in planned if k not in rows and k[:2] not in dropped}
    if missing:
        raise PhoenixError(
            f"{len(missing)} prompts still lack an answer: rerun distill to finish them"
        )
    summary = {
        "answers": len(mine),
        "conversations": len({r["task_id"] for r in mine}),
        "dropped_turns": len(dropped),
        "truncated": sum(r["finish_reason"] == "length" for r in mine),
        "extra_samples": sum(k in rows and k[2] >= 1 for k in planned),
        "answered_this_run": stats["answers"],
        "retries": stats["retries"],
        "mean_latency_s": sum(r["latency_s"] for r in mine) / len(mine) if mine else 0.0,
        "completion_tokens": sum(r["completion_tokens"] for r in mine),
        "elapsed_s_this_run": elapsed,
        "answers_per_minute_this_run": stats["answers"] / elapsed * 60 if asked else None,
        "tokens_per_second_this_run": stats["tokens"] / elapsed if asked else None,
        "teacher": "local" if cfg.teacher.url == "local" else cfg.teacher.url,
        "model": model,
        "concurrency": concurrency,
    }
    atomic_write_json(ws.teacher / "summary.json", summary)
    log.info("distill summary: %s", json.dumps(summary))
    return summary


def checked_logprobs(answer: Answer, task_id: int, url: str, cfg: Config) -> list[list]:
    """The answer's per-token logprobs; TeacherLogprobsMissing if absent or not spelling it."""
    where = f"train.objective={cfg.train.objective} asks the teacher at {url} for top_logprobs"
    if not answer.logprobs and not (answer.completion == "" and answer.logprobs is not None):
        raise TeacherLogprobsMissing(
            f"{where}, and it returned none (task_id {task_id}): use a teacher that returns "
            "logprobs (vLLM, SGLang, TGI, OpenAI), or train.kd_source=target to read the "
            "target's weights"
        )
    tokens = [e[0] for e in answer.logprobs]
    if not any(t.startswith("token_id:") for t in tokens) and "".join(tokens) != answer.completion:
        raise TeacherLogprobsMissing(
            f"{where}; for task_id {task_id} its logprob tokens do not spell its answer "
            f"({len(tokens)} tokens)"
        )
    return answer.logprobs


def request_extra(cfg: Config) -> dict[str, Any]:
    """The chat request's extra fields: template switches, logprobs for kd, token ids."""
    extra: dict[str, Any] = {}
    if cfg.template_kwargs():
        extra["chat_template_kwargs"] = cfg.template_kwargs()
    n_logprobs = cfg.requested_logprobs()
    if n_logprobs:
        extra.update(logprobs=True, top_logprobs=n_logprobs)
    if cfg.teacher.url == "local":
        extra["phoenix"] = {"token_ids": True}
        if n_logprobs:
            extra["return_tokens_as_token_ids"] = True
    elif cfg.teacher.return_token_ids:  # vLLM's field for them (other servers may refuse it)
        extra["return_token_ids"] = True
    return extra


def answer_row(p: dict, sample: int, temperature: float, answer: Answer) -> dict[str, Any]:
    """One line of answers.jsonl (without its logprobs)."""
    row = {
        "task_id": p["task_id"],
        **({"sample": sample, "temperature": temperature} if sample else {}),
        "prompt": p["prompt"],
        "completion": answer.completion,
        "finish_reason": answer.finish_reason,
        "completion_tokens": answer.completion_tokens,
        "prompt_tokens": answer.prompt_tokens,
        "model": answer.model,
        "latency_s": round(answer.latency_s, 4),
    }
    if answer.token_ids is not None:
        row["completion_token_ids"] = answer.token_ids
    if answer.reasoning is not None:  # kept apart; trained on with train.include_reasoning
        row["reasoning"] = answer.reasoning
    return row


class _NeedsTeacher(Exception):
    pass


def walk(cfg: Config, p: dict, turns: dict, done: dict, fits, dropped: set, ask: Callable) -> None:
    """A conversation's answers in order: per answered user turn its history (the main answers
    so far), then sample 0..distill.extra_samples, each from `done` or `ask(p, history, turn,
    sample) -> row`. A turn whose history does not `fit`: it and later turns go to `dropped`."""
    tid, mode, messages = p["task_id"], cfg.distill.turns, messages_of(p)
    said: list[str] = []  # the teacher's main answers, by user turn (turns=all)
    for turn in turns[tid]:
        request = history(messages, turn, said, mode)
        if fits is not None and not fits(request):
            dropped.update([(tid, x) for x in turns[tid] if x >= turn])
            return
        for sample in range(cfg.distill.extra_samples + 1):
            row = done.get((tid, turn, sample)) or ask(p, request, turn, sample)
            if sample == 0:
                said.append(row["completion"])


def _needs_teacher(cfg: Config, p: dict, turns: dict, done: dict, fits, dropped: set) -> bool:
    """Whether `p` has an answer to ask for (False: done, or what is left does not fit)."""

    def ask(*_):
        raise _NeedsTeacher

    try:
        walk(cfg, p, turns, done, fits, dropped, ask)
    except _NeedsTeacher:
        return True
    return False


def _answer_all(
    cfg: Config,
    ws: Workspace,
    url: str,
    model: str,
    jobs: list[dict],
    turns: dict,
    done: dict,
    stats: dict,
    concurrency: int,
    fits,
) -> None:
    """Walk every conversation of `jobs` (`walk`), asking for each answer not in `done` and
    appending each row as it comes; conversations in parallel, a conversation's turns in order."""
    t = cfg.teacher
    api_key = os.environ.get(t.api_key_env) if t.url != "local" else None
    client = TeacherClient(
        url,
        api_key,
        t.request_timeout_s,
        t.max_retries,
        RetryBudget(t.retry_budget),
        pool_size=max(10, concurrency),
    )
    client.wait_ready(model, t.ready_timeout_s, 0.25 if t.url == "local" else 4.0)
    extra = request_extra(cfg)
    n_logprobs = cfg.requested_logprobs()
    ws.teacher.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    t0 = time.perf_counter()
    n_samples = cfg.distill.extra_samples + 1
    total = sum((tid, x, j) not in done for tid in (p["task_id"] for p in jobs)
                for x in turns[tid] for j in range(n_samples))  # fmt: skip
    bar = tqdm(total=total, desc="teacher answers", unit="ans", dynamic_ncols=True)

    def ask(p: dict, request: list[dict], turn: int, sample: int) -> dict:
        temperature = t.temperature if sample == 0 else cfg.distill.sample_temperature
        seed = (int(p["task_id"]) * 1000 + 100 * turn + sample) % 2**31  # a rerun draws the same
        seeded = {**extra, "seed": seed} if temperature > 0 else extra
        answer, retries = client.chat(model, request, t.max_tokens, temperature, seeded)
        row = answer_row(p, sample, temperature, answer)
        if "messages" in p:
            row.update(turn=turn, messages=request, prompt=request[-1]["content"])
        if n_logprobs:
            row["completion_logprobs"] = checked_logprobs(answer, p["task_id"], url, cfg)
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with lock:
            if client.cancel.is_set():  # the stage has ended (failure, Ctrl-C): write no more
                raise _NeedsTeacher
            append_line(ws.answers_file, line)
            stats["retries"] += retries
            stats["answers"] += 1
            stats["tokens"] += answer.completion_tokens
            bar.update(1)
            bar.set_postfix(
                tok_s=f"{stats['tokens'] / (time.perf_counter() - t0):.1f}",
                retries=stats["retries"],
            )
        return row

    def one(p: dict) -> None:
        before = len(stats["dropped"])
        try:
            walk(cfg, p, turns, done, fits, stats["dropped"], ask)
        except _NeedsTeacher:
            return
        if len(stats["dropped"]) > before:
            with lock:
                left = [k for k in stats["dropped"] if k[0] == p["task_id"]]
                bar.total -= sum((p["task_id"], x, j) not in done for _, x in left
                                 for j in range(n_samples))  # fmt: skip
                bar.refresh()

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="teacher")
    try:
        futures = [pool.submit(one, p) for p in jobs]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in finished:
            if f.exception() is not None:
                raise f.exception()
    finally:
        client.cancel.set()  # queued prompts dropped, in-flight ones stop retrying
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
