"""The local teacher: Phoenix's own server in target-only mode, started as a child process on a
free loopback port for the distill stage and stopped afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator

from .config import Config, dump_config
from .subprocs import PREEXEC, free_port, stop
from .workspace import Workspace, atomic_write_text

log = logging.getLogger(__name__)


def serve_command(config, artifacts, port: int, mode: str, extra: list[str] = ()) -> list[str]:
    """`python -m pipeline serve` on 127.0.0.1:port (the local teacher, the engine benchmark)."""
    return [
        *(sys.executable, "-m", "pipeline", "serve", "--config", str(config)),
        *("--artifacts", str(artifacts), "--host", "127.0.0.1", "--port", str(port)),
        *("--mode", mode, *extra),
    ]


def local_context(cfg: Config, ws: Workspace, prompts: list[str]) -> int:
    """The context (prompt + answer, tokens) the local teacher needs for `prompts`: the longest
    of them as the server will see it (chat template, `template_kwargs`) plus
    `teacher.max_tokens`, or `engine.max_context` where that is longer (the configured context
    alone may refuse a long training prompt: 273 + 256 answer tokens pass 512)."""
    from . import models, specs  # torch and transformers: only when the local teacher runs

    tok = models.load_tokenizer(specs.resolve(cfg.models.target, ws.models_cache))
    kwargs = cfg.template_kwargs()
    longest = max((len(models.user_prompt_ids(tok, p, kwargs)) for p in prompts), default=0)
    return max(cfg.engine.max_context, longest + cfg.teacher.max_tokens)


def local_teacher_config(cfg: Config, context: int | None = None) -> Config:
    """The local teacher's config: eager (its answers run in padded batches; compiling would
    only cost start-up), the full head, no traffic capture (distillation's own requests are not
    served traffic), and a context of `context` tokens (default the engine's)."""
    eager = cfg.engine.model_copy(
        update={"compile": "false", "draft_vocab": 0,
                "max_context": context or cfg.engine.max_context}
    )  # fmt: skip
    quiet = cfg.traffic.model_copy(update={"capture": False})
    return cfg.model_copy(update={"engine": eager, "traffic": quiet})


@contextlib.contextmanager
def local_teacher(cfg: Config, ws: Workspace, context: int | None = None) -> Iterator[str]:
    """Start `python -m pipeline serve --mode target` on a free loopback port (its config:
    `local_teacher_config`); yield its URL."""
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
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=PREEXEC,
        )
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)
        log.info("local teacher stopped")
