"""Compiling the step loop's passes (`engine.compile`): each model's whole pass as one graph,
warmed at the shapes the loop makes before the server says it is ready, kept only where it
measures faster than eager under `auto`."""

from __future__ import annotations

import logging

from .errors import PhoenixError

log = logging.getLogger(__name__)


def _progress(label: str, i: int, total: int, secs: float) -> None:
    log.info("engine: warmed %s [%d/%d] in %.1f s", label, i, total, secs)


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def compile_engine(cfg, ws, pair) -> bool:
    """Ready a pair's lean runners and, per `engine.compile`, compile and warm each pass (caches
    under <artifacts>/cache/compile). `auto`: kept only where measured faster than eager (1- and
    5-token steps), eager with a warning if compiling fails; `true`: fails loudly. A reload
    compiles only what is new. Returns whether the target runs compiled."""
    import os
    import time

    from .speculative.runner import prepare, step_ms, warm_up

    how = cfg.engine.compile
    models_ = [m for m in dict.fromkeys([pair.target, pair.draft]) if m is not None]
    for m in models_:
        prepare(m, cfg.engine.max_context)
    runners = [m._phoenix_runner for m in models_ if m._phoenix_runner is not None]
    if how == "false":
        return False
    if not runners:
        msg = f"engine.compile={how}: {pair.target_ref} has no lean runner to compile"
        if how == "true":
            raise PhoenixError(msg)
        log.warning("%s: eager", msg)
        return False
    target, head = pair.target, pair.models.head
    trun = target._phoenix_runner
    if trun is not None and trun.tried and not trun.compiled:
        return False  # decided eager for this target at start-up: a reload keeps it so
    cache = ws.compile_cache
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _user_inductor_cache() or str(cache / "inductor")
    taps = [(), tuple(head.config.aux_layer_ids)] if head is not None else [()]

    fresh = [m for m in models_ if m._phoenix_runner is not None and not m._phoenix_runner.compiled]
    if not fresh:  # a shared target, compiled already (a reload)
        if trun is not None and set(taps) - trun.warm_taps:  # a new head reading other layers
            warm_up(target, sorted(set(taps) - trun.warm_taps), _progress)
        if head is not None and not head.compiled:
            compile_head(head, how, cfg.engine.backend)
        return True
    for m in fresh:
        m._phoenix_runner.tried = True
    probe = (1, 5)
    measure = how == "auto" and target in fresh  # a new draft beside a compiled target follows it
    eager = {n: step_ms(target, n) for n in probe} if measure else {}
    t0 = time.perf_counter()
    log.info("engine: compiling the step loop's pass (%s): minutes (torch's cache: %s)",
             pair.models.device.type, os.environ["TORCHINDUCTOR_CACHE_DIR"])  # fmt: skip
    try:
        for m in fresh:
            m._phoenix_runner.compile(backend=cfg.engine.backend)
            warm_up(m, taps if m is target else [()], _progress)
    except Exception as exc:  # noqa: BLE001 - any compile failure means eager under auto
        for m in fresh:
            m._phoenix_runner.uncompile()
        reason = _reason(exc)
        if how == "true":
            raise PhoenixError(f"engine.compile=true: compiling failed: {reason}") from exc
        log.warning("engine.compile=auto: running eager, compiling failed: %s", reason)
        return False
    log.info("engine: compiled and warm in %.1f s", time.perf_counter() - t0)
    if measure:
        compiled = {n: step_ms(target, n) for n in probe}
        figures = ", ".join(f"{n} token(s) {compiled[n]:.1f} vs {eager[n]:.1f} ms" for n in probe)
        if sum(compiled.values()) >= sum(eager.values()):
            for m in fresh:
                m._phoenix_runner.uncompile()
            log.warning("engine.compile=auto: the compiled pass measured slower than eager on "
                        "this machine (%s, compiled vs eager): running eager", figures)  # fmt: skip
            return False
        log.info("engine.compile=auto: the compiled pass kept (%s, compiled vs eager)", figures)
    if pair.models.head is not None:
        compile_head(pair.models.head, how, cfg.engine.backend)
    return True


def _user_inductor_cache() -> str | None:
    """`TORCHINDUCTOR_CACHE_DIR` if the user chose it; None if unset or torch's own default
    (importing its compiler sets that)."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        return None
    return chosen


def compile_head(head, how: str, backend: str) -> bool:
    """Compile and warm an EAGLE-3 head's dense parts, with `compile_engine`'s `auto`/`true`
    rules (its one-token step measured). Returns whether the head runs compiled."""
    eager = head.step_ms() if how == "auto" else None
    try:
        head.compile(backend=backend)
        head.warm_up()
    except Exception as exc:  # noqa: BLE001 - any compile failure means eager under auto
        head.uncompile()
        reason = _reason(exc)
        if how == "true":
            raise PhoenixError(f"engine.compile=true: compiling the head failed: {reason}") from exc
        log.warning(
            "engine.compile=auto: the EAGLE-3 head runs eager, compiling failed: %s", reason
        )
        return False
    if how == "auto":
        ms = head.step_ms()
        if ms >= eager:
            head.uncompile()
            log.warning("engine.compile=auto: the EAGLE-3 head's compiled step measured slower "
                        "than eager (%.2f vs %.2f ms): eager", ms, eager)  # fmt: skip
            return False
        log.info("engine.compile=auto: the EAGLE-3 head's step %.2f ms compiled vs %.2f eager: "
                 "compiled", ms, eager)  # fmt: skip
    return True
