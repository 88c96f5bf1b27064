"""The errors that end a command with one line a user can act on.

The CLI prints the message instead of a traceback (exit code 2 for a mistake in the
input, the error's own code for a run that failed). They live here, below every module
that raises them, so that no two modules import each other for an exception class.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` with control characters escaped (``\\x1b``), so that text from a store, a
    file or a worker cannot drive the terminal it is printed on; tabs stay, and newlines
    too with ``lines`` (else they are escaped as well)."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if lines else text.replace("\n", "\\n")


class DataError(ValueError):
    """A data problem the user caused and can fix.

    The message is one line that names the flag or file and says what would work, e.g.
    ``--data books/: no such file or folder``.
    """


class LaunchError(RuntimeError):
    """The workers failed; the message is the one line to show, ``code`` the exit code and
    ``detail`` a traceback to print first (only when it could not be written to a log)."""

    def __init__(self, message: str, code: int = 1, detail: str | None = None):
        super().__init__(message)
        self.code, self.detail = code, detail


class CheckpointError(RuntimeError):
    """A missing, incomplete, damaged or unreadable checkpoint (message is one line)."""
