"""How many torch operations one decoding iteration dispatches outside compiled code.

On a GPU every operation the host dispatches eagerly is a kernel launch it pays for in host time,
however little the kernel does; inside a compiled region the operations become a few fused
kernels (one CUDA graph replay, where captured). So the eager operations per iteration are what
a GPU's host time follows, and this CPU can count them::

    python -m sjd_core.tools.eager_ops                    # ar, sjd, pac+vp, auto; compiled
    python -m sjd_core.tools.eager_ops --modes ar --top 20

Each mode runs on the engine tests' small synthetic model with ``compile`` and ``compile_stages``
on: a few generations compile, then one runs under torch's profiler, which records every aten
operation the host dispatches and every compiled region (torch names them "Torch-Compiled Region"). An operation counts when it runs
inside one iteration of the decoding loop (from one progress report to the next: the first
iteration and what a generation does once, such as the prefill, are left out) and no compiled
region and no other aten operation encloses it (an operation called by another is the caller's
work).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch.profiler import record_function

from .cli import set_threads

if TYPE_CHECKING:
    from ..decoding.engine import IterationReport

MODES = ("ar", "sjd", "pac+vp", "auto")
COMPILED_REGION = "Torch-Compiled Region"  # the profiler's name for a compiled region's run
ITERATION = "sjd: one iteration"  # the span this tool marks around each counted iteration


@dataclass
class EagerOps:
    """Operations dispatched outside compiled code in one generation: per iteration, and by
    operation over the whole generation."""

    mode: str
    iterations: int
    by_operation: Counter

    @property
    def per_iteration(self) -> float:
        return sum(self.by_operation.values()) / self.iterations


def outside_compiled(events, within: str = ITERATION) -> Counter:
    """The aten operations among the profiler's ``events`` that a span named ``within``
    encloses and no compiled region and no other aten operation does, counted by name."""
    def counted(event) -> bool:
        if not event.name.startswith("aten::"):
            return False
        parent, inside = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name.startswith(COMPILED_REGION):
                return False
            inside |= parent.name == within
            parent = parent.cpu_parent
        return inside

    return Counter(event.name for event in events if counted(event))


def count_mode(mode: str, warm_runs: int = 2) -> EagerOps:
    """Compile ``mode`` on the small synthetic model (``warm_runs`` generations), then count the
    eager operations of one more."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ..decoding.engine import generate
    from ..decoding.settings import AccelerationSettings, SamplingSettings
    from ..models.protocol import GenerationRequest
    from ..models.synthetic import SyntheticModel

    model = SyntheticModel(codebook_size=32, grid=(6, 6), width=32, layers=1, heads=2,
                           sharpness=2.0, seed=5)
    settings = AccelerationSettings.preset(mode, compile=True, compile_stages=True)
    if mode == "auto":  # its choice by forward passes: the same shapes on every machine
        settings = replace(settings, shape_cost="passes")
    request, sampling = GenerationRequest(prompt="a red fox"), SamplingSettings(guidance=2.0)
    # from a clean slate: graphs the process compiled before count against torch's limit per
    # function, past which it runs the function uncompiled
    torch.compiler.reset()
    for seed in range(warm_runs):
        generate(model, request, sampling, settings, seed=seed)
    spans = IterationSpans()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        generate(model, request, sampling, settings, seed=warm_runs, on_iteration=spans.mark)
    return EagerOps(mode, spans.count, outside_compiled(profiler.events()))


class IterationSpans:
    """Marks each iteration of a generation but the first as a profiler span named
    ``ITERATION``: from one progress report (``mark``, the engine's ``on_iteration``) to the
    next, which is the loop's whole body, from choosing the shape to dropping finished rows."""

    def __init__(self) -> None:
        self.open: record_function | None = None
        self.count = 0

    def mark(self, report: IterationReport) -> None:
        """Close the span of the iteration ``report`` ends, and open the next one's unless every
        image is finished."""
        if report.compiling:  # a note sent before an iteration, not the end of one
            return
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.count += 1
        finished = all(done >= report.total for done in report.committed)
        self.open = None if finished else record_function(ITERATION)
        if self.open is not None:
            self.open.__enter__()


def format_counts(counts: list[EagerOps], top: int) -> str:
    """A line per mode, then its ``top`` operations per iteration."""
    lines = []
    for count in counts:
        lines.append(f"{count.mode}: {count.per_iteration:.1f} eager operations per iteration "
                     f"({count.iterations} iterations)")
        for name, number in count.by_operation.most_common(top):
            lines.append(f"  {number / count.iterations:6.2f} {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--top", type=int, default=8, help="operations listed per mode")
    args = parser.parse_args(argv)
    modes = [mode.strip().lower() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes {args.modes!r} names {', '.join(unknown)}; allowed: "
                     f"{', '.join(MODES)}")
    set_threads(1)
    print(format_counts([count_mode(mode) for mode in modes], args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
