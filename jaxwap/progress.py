"""A one-line progress bar on stderr, for the slow stages a person waits on (calibration,
measured choice). No dependency; silent when disabled."""

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
