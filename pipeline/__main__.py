"""Phoenix command line.

    python -m pipeline <stage> --config FILE [--artifacts DIR] [--set key.path=value ...]

Stages: split, distill, train, merge, bench, retrain, serve, demo, tune-vllm (vllm.py). Exit
codes are in errors.py and the README. Every stage but serve holds <artifacts>/phoenix.lock.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from . import errors
from .config import Config, dump_config, load_config
from .telemetry import NullTelemetry, setup_telemetry
from .workspace import Workspace, atomic_write_text

log = logging.getLogger("pipeline")

STAGES = ["split", "distill", "train", "merge", "bench", "retrain", "serve", "demo", "tune-vllm"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--config", default="configs/default.yaml", help="YAML config file")
    p.add_argument("--artifacts", default="artifacts", help="root of every output")
    p.add_argument("--cache", help="converted-model cache (default: <artifacts>/cache)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set data.train_size=100 (repeatable)",
    )  # fmt: skip
    p.add_argument("--host", help="serve: address to bind (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, help="serve: port (default from config)")
    p.add_argument("--mode", help="serve: target | fixed:K | bandit (default from config)")
    p.add_argument(
        "--engine", choices=["phoenix", "vllm"], default="phoenix",
        help="serve: Phoenix's own server, or vLLM with the served draft (make vllm)",
    )  # fmt: skip
    p.add_argument("--force", action="store_true", help="train: train again even if finished")
    p.add_argument(
        "--draft", choices=["base", "distilled", "both"], default="both",
        help="bench: which drafts to measure (default: bench.drafts from config)",
    )  # fmt: skip
    p.add_argument(
        "--url", help="bench: measure the held-out prompts on any OpenAI-compatible server at URL"
    )
    p.add_argument("--clients", type=int, help="bench --url: concurrent clients (1: the protocol)")
    p.add_argument(
        "--resume", metavar="RUN_ID", help="retrain: resume this run (default: latest unfinished)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


DEMO_STAGES = ("split", "distill", "train", "merge", "bench")


def trained_parts(cfg: Config, ws: Workspace) -> list[tuple[Config, Workspace]]:
    """What train and merge build, in order: the draft, then (models.head=distilled) the head."""
    return [(cfg, ws)] + ([(cfg.head_config(), ws.head())] if cfg.trains_head() else [])


def _prefixed(ws: Workspace, figures: dict) -> dict:
    return {f"{ws.part}_{k}" if ws.part else k: v for k, v in figures.items()}


def run_stage(stage: str, cfg: Config, ws: Workspace, args: argparse.Namespace, telemetry) -> None:
    """Log the resolved config, run the stage in its own telemetry transaction, then (only on
    success) store the config beside its outputs."""
    if stage == "demo":
        with ws.lock("demo", timing=cfg.lock):
            for s in DEMO_STAGES:
                log.info("=== demo: %s ===", s)
                run_stage(s, cfg, ws, args, telemetry)
        print(next_steps(cfg, ws, args), flush=True)
        return
    text = dump_config(cfg)
    log.info("%s: resolved config:\n%s", stage, text.rstrip())
    if stage == "retrain":
        from . import retrain

        retrain.run(cfg, ws.root, telemetry, resume=args.resume)
        return
    if stage == "serve" and args.engine == "vllm":
        from . import vllm

        code = vllm.serve(cfg, ws, args.host, args.port, args.mode)
        if code:
            failed = errors.PhoenixError(f"vLLM exited with {code}")
            failed.exit_code = code if 0 < code < 256 else errors.EXIT_FAILURE  # kept
            raise failed
        return
    if stage == "serve":
        from . import server

        server.serve(cfg, ws, args.host, args.port, args.mode)
        return
    with ws.lock(stage, timing=cfg.lock), telemetry.stage(stage) as figures:
        if stage == "split":
            from . import split

            figures.update(split.run(cfg, ws))
            atomic_write_text(ws.data / "config.yaml", text)
        elif stage == "distill":
            from . import teacher

            figures.update(teacher.run(cfg, ws))
            atomic_write_text(ws.teacher / "config.yaml", text)
        elif stage == "train":
            from . import train

            for c, w in trained_parts(cfg, ws):
                figures.update(_prefixed(w, train.run(c, w, force=args.force)))
                atomic_write_text(w.adapter / "config.yaml", dump_config(c))
        elif stage == "merge":
            from . import merge

            for c, w in trained_parts(cfg, ws):
                figures.update(_prefixed(w, merge.run(c, w)))
        elif stage == "bench" and args.url:
            from . import loadtest

            summary = loadtest.run_remote(cfg, ws, args.url, args.clients or 1)
            figures.update({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
        elif stage == "tune-vllm":
            from . import vllm_tune

            figures.update(vllm_tune.tune(cfg, ws))
        elif stage == "bench":
            from . import bench

            drafts = None if args.draft == "both" else [args.draft]
            figures.update(bench.run(cfg, ws, telemetry, drafts))
            atomic_write_text(ws.bench / "config.yaml", text)


def next_steps(cfg: Config, ws: Workspace, args: argparse.Namespace) -> str:
    """What `make demo` prints last: serve the draft it built, ask it something, read the report."""
    import shlex

    make_vars = []
    if args.config != "configs/default.yaml":
        make_vars.append(f"CONFIG={shlex.quote(args.config)}")
    if str(args.artifacts) != "artifacts":
        make_vars.append(f"ARTIFACTS={shlex.quote(str(args.artifacts))}")
    ask = [{"role": "user", "content": "Write a function to reverse a string."}]
    model = cfg.models.served_name or cfg.models.target
    body = json.dumps({"model": model, "messages": ask, "max_tokens": 64})
    auth = ""
    if os.environ.get(cfg.server.api_key_env):
        auth = f' -H "Authorization: Bearer ${cfg.server.api_key_env}"'
    url = f"http://{cfg.server.host}:{cfg.server.port}/v1/chat/completions"
    if cfg.trains_head():
        note = "    # serves the faster of the draft and the EAGLE-3 head just built"
    else:
        note = "    # serves the draft just built (server.draft: latest)"
    return "\n".join([
        "", "Next:", f"  make serve {' '.join(make_vars)}".rstrip() + note,
        f"  curl -s {url} -H 'Content-Type: application/json'{auth} -d '{body}'",
        f"  report: {ws.bench / 'report.md'}",
    ])  # fmt: skip


def what_was_kept(stage: str, ws: Workspace) -> str:
    """After a stage failed for lack of space: what survives, and how a rerun picks up."""
    if stage == "distill":
        path = ws.answers_file
        n = path.read_bytes().count(b"\n") if path.exists() else 0
        return f"{path} keeps the {n} answers written so far; a rerun asks only for the rest"
    if stage == "train":
        from .train import last_complete_checkpoint

        ckpts = ws.adapter / "checkpoints"
        last = last_complete_checkpoint(ckpts)
        kept = "no checkpoint was complete yet"
        if last:
            kept = f"{last} is kept and a rerun resumes from it"
        return f"writing {ckpts}: {kept} (an incomplete checkpoint is discarded)"
    if stage == "merge":
        return (
            f"{ws.merged} is swapped in whole (the previous draft or the new verified one) and "
            "the registry never holds a partial version"
        )
    if stage == "retrain":
        return "the run's finished stages are kept (runs/<id>/manifests); a rerun resumes at the failed one"
    return f"files under {ws.root} are replaced whole or not at all: earlier outputs are unchanged"


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stage != "serve":  # uvicorn installs its own handlers
        # Ctrl-C and SIGTERM stop a stage through its `finally` blocks, even if SIGINT was ignored.
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    ws = Workspace(args.artifacts, cache=args.cache)
    try:
        cfg = load_config(args.config, args.overrides)
        serving = args.stage == "serve"
        telemetry = NullTelemetry() if serving else setup_telemetry(cfg, f"stage:{args.stage}")
        try:
            run_stage(args.stage, cfg, ws, args, telemetry)
        finally:
            telemetry.flush()
        return errors.EXIT_OK
    except errors.PhoenixError as exc:
        log.error("%s", exc)
        return exc.exit_code
    except Exception as exc:
        if not errors.is_disk_full(exc, ws.root):
            raise
        kept = what_was_kept(args.stage, ws)
        log.error("%s: disk full under %s (%s); %s. Free space, then rerun %s.",
                  args.stage, ws.root, exc.__class__.__name__, kept, args.stage)  # fmt: skip
        return errors.EXIT_FAILURE
    except KeyboardInterrupt:
        log.error("interrupted")
        return errors.EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
