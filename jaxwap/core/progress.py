"""A one-line progress bar on stderr, for the slow stages a person waits on (calibration,
measured choice), and the one line that ends a command cut short by Ctrl-C. No
dependency; silent when disabled."""

from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, enabled: bool, label: str, width: int = 30) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.label, self.width = label, width

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = int(self.width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                         f"{self.done}/{self.total} {what:<28}")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# SIGINT's exit status, as a shell reports a command Ctrl-C ended
INTERRUPTED = 130


def from_interrupt(e: BaseException) -> bool:
    """Whether `e` is Ctrl-C's KeyboardInterrupt, or an error it caused on the way out.
    Ctrl-C raises where Python code runs, which may be a callback of C code (numpy asking
    a jax dtype for its numpy dtype); that C code then reports `SystemError: ... returned
    a result with an exception set`, the KeyboardInterrupt its context. Seen by the chain
    of causes and contexts, each error once."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def interrupted(what: str, saved: str) -> int:
    """Say on one line that `what` was interrupted and what that left saved (`saved`),
    after ending a progress line it may have cut short; returns the exit status of a
    command ended by Ctrl-C. A traceback there would tell a person nothing they need."""
    sys.stderr.write(f"\n{what}: interrupted; {saved}\n")
    sys.stderr.flush()
    return INTERRUPTED
