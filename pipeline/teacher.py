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
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .config import Config, dump_config
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


def local_context(cfg: Config, ws: Workspace, prompts: list[str]) -> int:
    """Tokens of context the local teacher needs: the longest rendered prompt plus
    `teacher.max_tokens`, or `engine.max_context` where that is longer."""
    from . import models, specs  # torch and transformers: only when the local teacher runs

    tok = models.load_tokenizer(specs.resolve(cfg.models.target, ws.models_cache))
    kwargs = cfg.template_kwargs()
    longest = max((len(models.user_prompt_ids(tok, p, kwargs)) for p in prompts), default=0)
    return max(cfg.engine.max_context, longest + cfg.teacher.max_tokens)


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
def load_answers(path: Path) -> dict[int, dict]:
    """The main answers (sample 0) already written, by task_id."""
    return {tid: row for (tid, j), row in load_all_answers(path).items() if j == 0}


def load_all_answers(path: Path) -> dict[tuple[int, int], dict]:
    """Every row by (task_id, sample) (0: the main answer; absent `sample` = 0): the first of
    each, or the first with logprobs. A torn last line is cut off the file."""
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
    rows: dict[tuple[int, int], dict] = {}
    for n, line in enumerate(raw[:cut].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (int(row["task_id"]), int(row.get("sample", 0)))
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
    done = load_all_answers(ws.answers_file)  # (task_id, sample) -> row
    if n_logprobs:  # answers written without logprobs (an sft run) are asked again
        done = {k: r for k, r in done.items() if "completion_logprobs" in r}
    wanted = {p["task_id"] for p in prompts}
    todo = [(p, j) for j in range(n_extra + 1) for p in prompts
            if (p["task_id"], j) not in done]  # fmt: skip
    log.info(
        "distill: %d prompts, %d already answered, %d answers to go (%d extra samples each)",
        len(prompts),
        sum((t, 0) in done for t in wanted),
        len(todo),
        n_extra,
    )
    model = cfg.teacher.model or cfg.models.served_name or cfg.models.target
    stats = {"retries": 0, "tokens": 0}
    t_start = time.perf_counter()
    local = cfg.teacher.url == "local"
    concurrency = max(cfg.teacher.concurrency, cfg.server.max_batch if local else 1)  # fill it
    if todo:
        if local:
            context = local_context(cfg, ws, [p["prompt"] for p, _ in todo])
            with local_teacher(cfg, ws, context) as url:
                _answer_all(cfg, ws, url, model, todo, stats, concurrency)
        else:
            _answer_all(cfg, ws, cfg.teacher.url, model, todo, stats, concurrency)
    elapsed = time.perf_counter() - t_start
    rows = load_all_answers(ws.answers_file)
    mine = [rows[(p["task_id"], 0)] for p in prompts if (p["task_id"], 0) in rows]
    missing = wanted - {t for t, j in rows if j == 0}
    if missing:
        raise PhoenixError(
            f"{len(missing)} prompts still lack an answer: rerun distill to finish them"
        )
    summary = {
        "answers": len(mine),
        "truncated": sum(r["finish_reason"] == "length" for r in mine),
        "extra_samples": sum(t in wanted and 1 <= j <= n_extra for t, j in rows),
        "answered_this_run": len(todo),
        "retries": stats["retries"],
        "mean_latency_s": sum(r["latency_s"] for r in mine) / len(mine) if mine else 0.0,
        "completion_tokens": sum(r["completion_tokens"] for r in mine),
        "elapsed_s_this_run": elapsed,
        "answers_per_minute_this_run": len(todo) / elapsed * 60 if todo and elapsed > 0 else None,
        "tokens_per_second_this_run": stats["tokens"] / elapsed if todo and elapsed > 0 else None,
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
    return row


def _answer_all(
    cfg: Config,
    ws: Workspace,
    url: str,
    model: str,
    todo: list[tuple[dict, int]],
    stats: dict,
    concurrency: int,
) -> None:
    """Ask for every (prompt, sample) of `todo`, appending each row as it comes."""
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
    bar = tqdm(total=len(todo), desc="teacher answers", unit="ans", dynamic_ncols=True)

    def one(p: dict, sample: int) -> None:
        temperature = t.temperature if sample == 0 else cfg.distill.sample_temperature
        seed = int(p["task_id"]) * 1000 + sample  # a rerun draws the same
        seeded = {**extra, "seed": seed} if temperature > 0 else extra
        answer, retries = client.chat(
            model, [{"role": "user", "content": p["prompt"]}], t.max_tokens, temperature, seeded
        )
        row = answer_row(p, sample, temperature, answer)
        if n_logprobs:
            row["completion_logprobs"] = checked_logprobs(answer, p["task_id"], url, cfg)
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with lock:
            if client.cancel.is_set():  # the stage has ended (failure, Ctrl-C): write no more
                return
            append_line(ws.answers_file, line)
            stats["retries"] += retries
            stats["tokens"] += answer.completion_tokens
            bar.update(1)
            bar.set_postfix(
                tok_s=f"{stats['tokens'] / (time.perf_counter() - t0):.1f}",
                retries=stats["retries"],
            )

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="teacher")
    try:
        futures = [pool.submit(one, p, j) for p, j in todo]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
    finally:
        client.cancel.set()  # queued prompts dropped, in-flight ones stop retrying
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
