"""Telemetry behind one interface; the do-nothing twin is used when observability is off.

The core never branches on "is Sentry on": callers hold a telemetry object and call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class NullTelemetry:
    """Same methods as the Sentry telemetry; records nothing."""

    enabled = False

    def request(self, core, prompt_ids, max_tokens, mode, stop=None, on_text=None, cancel=None):
        return core.generate(
            prompt_ids, max_tokens, mode, stop=stop, on_text=on_text, cancel=cancel
        )

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        yield {}

    def flush(self) -> None:
        pass


def setup_telemetry(cfg, component: str) -> NullTelemetry:
    return NullTelemetry()
