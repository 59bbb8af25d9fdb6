"""User errors and how every CLI reports them.

A `UserError` (or `ConfigError`, a subclass of ValueError raised for bad config keys, defined here
so that every config module can raise it; `farskip_jax.config` re-exports it) is a problem
with the user's input: a mesh that needs more devices than there are, a missing data path, a bad
value. CLIs wrap their `main` with `cli_main`, which prints such errors as one line naming the
problem and the fix, and exits with status 2, instead of a traceback. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import errno
import functools
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar


class UserError(Exception):
    """Bad input from the user; the message names the problem and how to fix it."""


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names the key."""


F = TypeVar("F", bound=Callable[..., int | None])

# A write the storage refused: a full disk, a quota, a file size limit, a read-only or failing device.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def storage_refusal(e: BaseException) -> str | None:
    """What the OS said when `e` is a write the storage refused (`STORAGE_ERRNOS`): the user's to fix
    (free space, then --resume), not a bug. Either an OSError, or TensorStore's ValueError for a
    failed file operation, which names the file and carries the OS error code; None otherwise."""
    if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    if isinstance(e, ValueError):
        code = re.search(r"os_error_code='(\d+)'", str(e))
        if code and int(code.group(1)) in STORAGE_ERRNOS:
            return str(e)
    return None


def user_error_types() -> tuple[type[BaseException], ...]:
    return (UserError, ConfigError, FileNotFoundError)


def cli_main(fn: Callable[[Sequence[str] | None], int | None]) -> Callable[[Sequence[str] | None], int]:
    """Wraps a CLI `main(argv)`: user errors become `error: <message>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        try:
            return int(fn(argv) or 0)
        except user_error_types() as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapper


def jsonl_values(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for every non-blank line of a JSONL file; a line that is not
    JSON is a UserError naming `label:line`."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{label}:{n}: not JSON ({e.msg})") from None

