"""Every decoding mode side by side on the synthetic model, measured in one run.

    python -m sjd_core.tools.bench [--grid 48] [--codebook 8192] [--images 1]
    python -m sjd_core.tools.bench --cache-scaling [--threads 1]

Prints one table: per mode, forward passes (NFE), step compression, mean accepted length,
wall-clock time relative to AR measured in the same run, and the share of the wall-clock time
spent outside the model's forward pass. The synthetic model is a random transformer, so the
numbers say how the modes compare on one model, not what a real checkpoint will do.
``measure`` and ``format_table`` are shared with the reference-model benchmark.
``--cache-scaling`` measures the decoding session's own cost instead (see :mod:`.session_bench`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..decoding.engine import generate
from ..models.protocol import GenerationRequest, ImageTokenModel
from ..models.synthetic import SyntheticModel
from ..decoding.settings import AccelerationSettings, SamplingSettings
from . import session_bench

MODES: list[tuple[str, dict]] = [
    ("AR", dict(window=1)),
    ("SJD", dict()),
    ("SJD+AC", dict(adaptive_continuation=True)),
    ("SJD+PD", dict(proactive_drafting=True)),
    ("PAC (SJD+AC+PD)", dict(adaptive_continuation=True, proactive_drafting=True)),
    ("SJD+VP", dict(verification_prediction=True)),
    ("PAC+VP", dict(adaptive_continuation=True, proactive_drafting=True,
                    verification_prediction=True)),
    ("PAC+VP+LANTERN", dict(adaptive_continuation=True, proactive_drafting=True,
                            verification_prediction=True, relaxed="lantern")),
    ("PAC+VP+GSD", dict(adaptive_continuation=True, proactive_drafting=True,
                        verification_prediction=True, relaxed="gsd")),
]


def measure(model: ImageTokenModel, request: GenerationRequest, sampling: SamplingSettings,
            acceleration: AccelerationSettings, seeds: Sequence[int]) -> dict:
    """Generate one image per seed (batch 1, so NFE is per image) and time the whole calls.

    Returns codes (N, H, W), wall ``seconds`` (prefill and set-up included), ``forward_share``
    of that time spent in the model's forward, and the mean NFE, step compression and accepted
    length over the images.
    """
    codes, summaries, seconds = [], [], 0.0
    for seed in seeds:
        start = time.perf_counter()
        result = generate(model, request, sampling, acceleration, seed=seed)
        seconds += time.perf_counter() - start
        codes.append(result.codes)
        summaries.append(result.trace.summary())
    forward = sum(s["forward_seconds"] for s in summaries)
    return {
        "codes": torch.cat(codes),
        "seconds": seconds,
        "forward_share": forward / seconds if seconds > 0 else 0.0,
        "nfe": float(np.mean([s["nfe"] for s in summaries])),
        "step_compression": float(np.mean([s["step_compression"] for s in summaries])),
        "mean_accepted_length": float(np.mean([s["mean_accepted_length"] for s in summaries])),
    }


def format_table(rows: list[dict[str, str]], columns: Sequence[str]) -> str:
    """A plain-text table with one line per row and aligned columns."""
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    line = lambda cells: "  ".join(str(x).rjust(w) if i else str(x).ljust(w)  # noqa: E731
                                   for i, (x, w) in enumerate(zip(cells, widths)))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(columns), rule] + [line([r.get(c, "") for c in columns]) for r in rows])


COLUMNS = ["mode", "NFE", "step compr.", "mean acc. len", "time vs AR", "outside fwd"]


def run(model: ImageTokenModel, sampling: SamplingSettings, window: int, seeds: Sequence[int],
        prompt: str) -> list[dict[str, str]]:
    """Measure every mode on the same prompt and seeds; returns the table rows."""
    rows, ar_seconds = [], None
    for label, options in MODES:
        settings = AccelerationSettings(**{"window": window, **options})
        result = measure(model, GenerationRequest(prompt=prompt), sampling, settings, seeds)
        ar_seconds = ar_seconds or result["seconds"]
        rows.append({
            "mode": label + ("" if settings.lossless else " (lossy)"),
            "NFE": f"{result['nfe']:.1f}",
            "step compr.": f"{result['step_compression']:.2f}x",
            "mean acc. len": f"{result['mean_accepted_length']:.2f}",
            "time vs AR": f"{result['seconds'] / ar_seconds:.3f}",
            "outside fwd": f"{100 * (1 - result['forward_share']):.1f}%",
        })
        print(f"  {label}: {result['nfe']:.0f} forward passes, {result['seconds']:.1f} s",
              flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m sjd_core.tools.bench", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--grid", type=int, default=48, help="grid side in codes (default 48)")
    parser.add_argument("--codebook", type=int, default=8192, help="codebook size (default 8192)")
    parser.add_argument("--window", type=int, default=16, help="window length (default 16)")
    parser.add_argument("--images", type=int, default=1, help="images per mode (default 1)")
    parser.add_argument("--width", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=2000, help="top-k (default 2000)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (default: torch's choice); 1 keeps timings "
                             "steady on a machine that is busy with other work")
    parser.add_argument("--cache-scaling", action="store_true",
                        help="measure the session's time outside the network per iteration at a "
                             "16x16 and a 64x64 grid, and plain autoregression next to "
                             "transformers' generate(), instead of comparing modes")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cache_scaling:
        return session_bench.run()
    model = SyntheticModel(codebook_size=args.codebook, grid=(args.grid, args.grid),
                           width=args.width, layers=args.layers, heads=4, sharpness=3.0,
                           seed=0, device=args.device)
    sampling = SamplingSettings(guidance=3.0, temperature=args.temperature, top_k=args.top_k)
    print(f"synthetic model: codebook {args.codebook}, grid {args.grid}x{args.grid}, width "
          f"{args.width}, {args.layers} layers, window {args.window}, {args.images} image(s) per "
          f"mode, device {args.device}", flush=True)
    rows = run(model, sampling, args.window, list(range(args.images)), "a red fox in the snow")
    table = format_table(rows, COLUMNS)
    print(table)
    return table


if __name__ == "__main__":
    main()
