"""A real `run_server` process whose target model stops making progress on request (tests).

    python -m tests.stuck_server MODEL_CACHE PORT SHUTDOWN_TIMEOUT_S

The first generation blocks in the target's forward pass forever (a stuck worker): SIGTERM
must still end the process within the shutdown deadline.
"""

import sys
from pathlib import Path

from pipeline import models, specs
from pipeline.server import create_app, run_server
from tests.conftest import TINY_TARGET
from tests.servers import Valve, tiny_core


def main() -> None:
    cache, port, deadline = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    t, d = specs.resolve_pair(TINY_TARGET, "cut:1", cache)
    tiny = (
        models.load_tokenizer(t),
        models.load_model(t, "float32", "cpu"),
        models.load_model(d, "float32", "cpu"),
    )
    Valve(tiny[1]).close()
    app = create_app(
        lambda: tiny_core(tiny, mode="fixed:2"), stuck_after_s=1.0, shutdown_timeout_s=deadline
    )
    run_server(app, "127.0.0.1", port)


if __name__ == "__main__":
    main()
