"""Errors that the command line maps to documented exit codes."""

import errno
import shutil
from pathlib import Path

# Exit codes (documented in the README; schedulers rely on them).
EXIT_OK = 0
EXIT_FAILURE = 1  # anything unexpected: a bug or an environment problem
EXIT_BAD_INPUT = 2  # bad config, bad input file, missing earlier stage
EXIT_TEACHER_UNAVAILABLE = 3  # teacher never became ready, or kept failing: retry later
EXIT_VERIFY_FAILED = 4  # merge verification or the bench's lossless check failed
EXIT_GATE_REJECTED = 5  # retrain: the new draft did not beat the promoted one
EXIT_LOCK_HELD = 6  # retrain: another run holds the lock
EXIT_INTERRUPTED = 130  # Ctrl-C


class PhoenixError(Exception):
    """An error with a message meant for the user and an exit code."""

    exit_code = EXIT_FAILURE


class ConfigError(PhoenixError):
    exit_code = EXIT_BAD_INPUT


class InputError(PhoenixError):
    exit_code = EXIT_BAD_INPUT


class TeacherUnavailable(PhoenixError):
    exit_code = EXIT_TEACHER_UNAVAILABLE


class VerificationError(PhoenixError):
    exit_code = EXIT_VERIFY_FAILED


class GateRejected(PhoenixError):
    exit_code = EXIT_GATE_REJECTED


class LockHeld(PhoenixError):
    exit_code = EXIT_LOCK_HELD


def is_disk_full(exc: BaseException, path: Path) -> bool:
    """Whether `exc` (or an error it was raised from) is the filesystem under `path` running out
    of space. Some writers (torch.save, safetensors) say only "write failed"; then a volume with
    almost nothing left is taken as the cause."""
    seen: set[int] = set()
    chain = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(chain):
            return True
        chain = chain.__cause__ or chain.__context__
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < 1 << 20
    except OSError:
        return False
