"""What the command-line tools share: one-line errors (:mod:`sjd_core.command_line`), a progress
bar per image, thread count.

Importing this module is cheap (no torch): the tools parse their arguments first, so ``--help``
and argument errors answer at once, and import torch and the models only to run.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..decoding.engine import IterationReport


def default_threads() -> int:
    """CPU threads for torch when the user names none: the cores this process may use, at most 4
    (more rarely helps these small forward passes and makes timings depend on the machine)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return max(1, min(4, usable))


def set_threads(requested: int) -> int:
    """Give torch ``requested`` CPU threads (0: :func:`default_threads`); returns the count."""
    import torch

    count = requested or default_threads()
    torch.set_num_threads(count)
    return count


COMPILING = "compiling a new shape (once per process)"  # the bar's note while it does


class ImageProgress:
    """A progress bar with ETA for one generated image (or batch), fed by the engine's
    ``on_iteration`` reports; codes committed so far out of all codes.

    It hands tqdm only the reports it would draw (one per ``REFRESH`` seconds, and the last):
    between iterations a tqdm update costs tens of microseconds even when it draws nothing,
    time the image would wait for."""

    REFRESH = 0.2  # seconds between redraws

    def __init__(self, label: str) -> None:
        self.label = label
        self.bar = None
        self.next_draw = 0.0

    def __call__(self, report: IterationReport) -> None:
        from tqdm import tqdm

        total, done = report.total * len(report.committed), sum(report.committed)
        now = time.monotonic()
        noted = self.bar is not None and bool(self.bar.postfix)  # the compiling note, to clear
        if done < total and now < self.next_draw and not (report.compiling or noted):
            return
        self.next_draw = now + self.REFRESH
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.label, unit="code", leave=False,
                            file=sys.stderr, dynamic_ncols=True, mininterval=self.REFRESH,
                            miniters=1)
        if report.compiling or noted:  # said while a new shape compiles
            self.bar.set_postfix_str(COMPILING if report.compiling else "", refresh=False)
        self.bar.update(done - self.bar.n)
        if report.compiling:
            self.bar.refresh()
        if done >= total:
            self.bar.refresh()  # show the finished bar, whatever the refresh interval skipped
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
