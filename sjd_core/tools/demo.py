"""Generate images from a prompt with an accelerated mode and show how much faster it was.

    python -m sjd_core.tools.demo --prompt "ankle boot"

Uses the embedded reference model unless ``--model`` names another checkpoint folder. For every
prompt it generates the images with the chosen mode (auto by default) and, in the same run,
with plain autoregression (AR) from the same seeds, then writes

* ``OUT/NAME.png``: the images, one row per prompt, one column per batch row;
* ``OUT/NAME_heatmap.png``: the first image with its per-slot acceptance maps;

and prints forward passes and wall-clock time of both modes and the speed-up (``--mode ar`` runs
AR once and prints no comparison). Lossless modes draw from the same distribution as AR, not the
same sample: the two images of one seed differ. A progress bar with ETA shows each batch; the
torch thread count is printed (``--threads``, default: the usable cores, at most 4), so printed
timings can be repeated. ``--compile`` runs the network of both modes compiled with
``torch.compile``; an untimed warm-up pays the compile time. Mistakes (an unknown prompt, a bad
setting) print one line and exit with code 2.

torch and the models are imported after the arguments are read, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..messages import quote
from ..decoding.settings import DEFAULT_PRESET, GUIDANCE_SCHEDULES, PRESETS, AccelerationSettings
from ..command_line import ArgumentParser, device_name, output_folder, run_command
from .cli import ImageProgress, set_threads

if TYPE_CHECKING:
    from ..decoding.engine import GenerationResult
    from ..decoding.settings import SamplingSettings
    from ..models.protocol import GenerationRequest, ImageTokenModel

PROG = "python -m sjd_core.tools.demo"
DEFAULT_PROMPT = "ankle boot"
DEFAULT_OUT = "output"
PREVIEW_PIXELS = 256  # small images are scaled up (nearest neighbour) to about this size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog=PROG,
        description="Generate images with speculative Jacobi decoding and compare with plain "
                    "autoregression in the same run. Writes the images and an acceptance heatmap.")
    parser.add_argument("--prompt", nargs="+", default=[DEFAULT_PROMPT],
                        help="one or more prompts; for the embedded model a Fashion-MNIST class "
                             "name or synonym, e.g. sneaker, 'ankle boot', bag "
                             f"(default: {quote(DEFAULT_PROMPT)})")
    parser.add_argument("--mode", default=DEFAULT_PRESET, choices=PRESETS,
                        help="accelerated mode to run (default: %(default)s)")
    parser.add_argument("--window", type=int, default=0,
                        help="the longest window of slots fed per forward pass (default 0: the "
                             "mode's own, 32 for auto and 16 for the others; ignored by "
                             "--mode ar)")
    parser.add_argument("--batch", type=int, default=1, help="images per prompt (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; image b uses seed + b")
    parser.add_argument("--guidance", type=float, default=None,
                        help="classifier-free guidance scale (default: the model's)")
    parser.add_argument("--guidance-schedule", default=None, choices=GUIDANCE_SCHEDULES,
                        help="how the guidance scale varies along the image: constant, or "
                             "lumina-mgpt-2 (Lumina-mGPT 2.0's official schedule, never below 4) "
                             "(default: the model's)")
    parser.add_argument("--temperature", type=float, default=None, help="(default: the model's)")
    parser.add_argument("--top-k", type=int, default=None, help="0 = off (default: the model's)")
    parser.add_argument("--top-p", type=float, default=None, help="1.0 = off (default: the model's)")
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: the embedded reference model)")
    parser.add_argument("--device", default=None, type=device_name,
                        help="e.g. cpu, cuda (default: CUDA if present)")
    parser.add_argument("--out", default=DEFAULT_OUT, type=output_folder,
                        help="output folder (default: %(default)s)")
    parser.add_argument("--name", default=None,
                        help="file name stem (default: the prompt, or 'samples' for several)")
    parser.add_argument("--scale", type=int, default=0,
                        help=f"pixel scale of the written images (default: up to about "
                             f"{PREVIEW_PIXELS} px per image)")
    parser.add_argument("--compile", action="store_true",
                        help="run the network compiled with torch.compile on any device (the "
                             "mode and the AR baseline alike; without it, CUDA records CUDA "
                             "graphs and other devices run uncompiled); the untimed warm-up pays "
                             "the compile time")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the AR run (no speed-up is printed)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default 0: the usable cores, at most 4)")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch={args.batch} is not allowed: it must be >= 1")
    if args.scale < 0:
        parser.error(f"--scale={args.scale} is not allowed: it must be >= 1 (or 0 = automatic)")
    if args.threads < 0:
        parser.error(f"--threads={args.threads} is not allowed: it must be >= 0")
    return args


def sampling_settings(model: ImageTokenModel, args: argparse.Namespace) -> SamplingSettings:
    """The model's own sampling recipe, with the flags the user gave on top."""
    from ..decoding.settings import SamplingSettings

    chosen = {"guidance": args.guidance, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p, "guidance_schedule": args.guidance_schedule}
    return SamplingSettings.of_recipe(model.defaults, **{name: value for name, value
                                                         in chosen.items() if value is not None})


def slug(text: str) -> str:
    """A file-name-safe stem for a prompt."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:60] or "unconditional"


def timed(model: ImageTokenModel, request: GenerationRequest, sampling: SamplingSettings,
          acceleration: AccelerationSettings, seed: int) -> tuple[GenerationResult, float]:
    """``generate`` and its wall-clock seconds, with a progress bar."""
    from ..decoding.engine import generate

    label = f"{acceleration.mode_name} {quote(request.prompt)}"
    bar = ImageProgress(label)
    started = time.perf_counter()
    try:
        result = generate(model, request, sampling, acceleration, seed, on_iteration=bar)
    finally:
        bar.close()
    return result, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict:
    """Generate, compare with AR, write both PNGs; returns the paths and measured numbers."""
    import torch

    with torch.inference_mode():
        return _run(args)


@dataclass
class Runs:
    """What the demo compares and what it measured: seconds and forward passes per run kind."""

    fast: AccelerationSettings
    baseline: AccelerationSettings
    compare: bool  # also run AR (not when the mode is AR itself or --no-baseline)
    eager_baseline: AccelerationSettings | None  # uncompiled AR, when the modes run compiled
    outside: bool  # also time transformers' generate() (the reference model)
    totals: dict[str, list[float]] = field(default_factory=lambda: {
        "fast": [0.0, 0.0], "ar": [0.0, 0.0], "ar_eager": [0.0, 0.0], "generate": [0.0, 0.0]})


def _runs(args: argparse.Namespace, model: ImageTokenModel, compiled_on: str) -> Runs:
    """The accelerated mode asked for, its AR baseline and which comparisons to make."""
    from dataclasses import replace

    compile_setting = True if args.compile else None  # None: compiled on CUDA only
    fast = AccelerationSettings.preset(args.mode, compile=compile_setting)
    if fast.window > 1 and args.window != 0:
        fast = AccelerationSettings.preset(args.mode, window=args.window, compile=compile_setting)
    baseline = AccelerationSettings.preset("ar", compile=compile_setting)
    compare = not args.no_baseline and fast != baseline
    compiled = fast.compiles_on(compiled_on)
    return Runs(fast, baseline, compare,
                replace(baseline, compile=False) if compare and compiled else None,
                compare and getattr(model, "family", "") == "reference")


def _run(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from ..decoding.engine import generate
    from ..models.protocol import GenerationRequest
    from ..models.reference import WEIGHTS_DIR
    from ..models.registry import load_model

    threads = set_threads(args.threads)
    print(f"torch CPU threads: {threads} (--threads to change)", flush=True)
    model = load_model(args.model or WEIGHTS_DIR, device=args.device)
    sampling = sampling_settings(model, args)
    device = torch.device(model.device).type
    runs = _runs(args, model, device)
    requests = [GenerationRequest(prompt=p, batch_size=args.batch, guidance=sampling.guidance)
                for p in args.prompt]
    check_prompts(model, requests)
    # Warm-up (one-time allocations, lazy initialisation, compiling the batch's shapes) so no
    # timed run pays for it.
    compiled = runs.fast.compiles_on(device)
    warm_up = requests[0] if compiled else GenerationRequest(prompt=args.prompt[0],
                                                             guidance=sampling.guidance)
    for warmed in [runs.fast] + ([runs.baseline] if runs.eager_baseline is not None else []):
        generate(model, warm_up, sampling, warmed, args.seed)
    images, first = [], None
    for request in requests:
        result = _time_request(model, request, sampling, args, runs)
        decoded = model.decode(result.codes).float().cpu().numpy()
        images.append(decoded)
        first = first or (result, decoded[0])
    image_path, heatmap_path = _write_pictures(args, np.concatenate(images), *first)
    report = _report(runs, first[0], f"{len(requests)} batch(es) of {args.batch}", sampling)
    report.update(image=str(image_path), heatmap=str(heatmap_path))
    print(f"wrote {image_path} and {heatmap_path}")
    return report


def _time_request(model: ImageTokenModel, request: GenerationRequest,
                  sampling: SamplingSettings, args: argparse.Namespace,
                  runs: Runs) -> GenerationResult:
    """Run one request in the accelerated mode and in each baseline, adding up their times."""
    totals = runs.totals
    result, seconds = timed(model, request, sampling, runs.fast, args.seed)
    totals["fast"][0] += seconds
    totals["fast"][1] += result.trace.summary()["iterations"]
    if runs.compare:
        reference, seconds = timed(model, request, sampling, runs.baseline, args.seed)
        totals["ar"][0] += seconds
        totals["ar"][1] += reference.trace.summary()["iterations"]
    if runs.eager_baseline is not None:  # compiled AR is not the only baseline: the faster one is
        totals["ar_eager"][0] += timed(model, request, sampling, runs.eager_baseline,
                                       args.seed)[1]
    if runs.outside:
        from .bench import transformers_generate

        totals["generate"][0] += transformers_generate(model, request.prompt, args.batch,
                                                       sampling, args.seed)
    return result


def _write_pictures(args: argparse.Namespace, grid: object, result: GenerationResult,
                    image: object) -> tuple[Path, Path]:
    """The images as one grid and the first image's acceptance heatmaps, as two PNGs."""
    from ..figures import acceptance_figure, image_grid

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or (slug(args.prompt[0]) if len(args.prompt) == 1 else "samples")
    scale = args.scale or max(1, PREVIEW_PIXELS // max(grid.shape[1:3]))
    image_path, heatmap_path = out / f"{name}.png", out / f"{name}_heatmap.png"
    image_grid(grid, columns=args.batch, scale=scale).save(image_path)
    acceptance_figure(result.trace.slot_maps(), image, row=0,
                      cell=max(2, PREVIEW_PIXELS // result.codes.shape[2])).save(heatmap_path)
    return image_path, heatmap_path


def _report(runs: Runs, result: GenerationResult, batches: str,
            sampling: SamplingSettings) -> dict:
    """Print the runs and the speed-up against the fastest baseline; returns the numbers."""
    totals, fast = runs.totals, runs.fast
    summary = result.trace.summary()
    report = {"mode": fast.mode_name, "seconds": totals["fast"][0], "nfe": totals["fast"][1],
              "step_compression": summary["step_compression"]}
    print(f"{fast.mode_name}: {totals['fast'][1]:.0f} forward passes, {totals['fast'][0]:.2f} s "
          f"for {batches} image(s) of {summary['slots_per_image']} codes "
          f"(window {fast.window}, {sampling})")
    if result.trace.meta.get("compile", {}).get("failure"):
        print(f"WARNING: {result.trace.meta['compile']['failure']}")
    if len(summary["shapes"]) > 1:
        from ..decoding.trace import shape_counts_text

        print("  steps by shape (first image): " + shape_counts_text(summary["shapes"]))
    if summary["auto_choice"]:
        print(f"  fed {summary['auto_choice']} (first image)")
    if not runs.compare:
        return report
    baseline_seconds = totals["ar"][0]
    print(f"AR: {totals['ar'][1]:.0f} forward passes, {totals['ar'][0]:.2f} s, same prompts "
          f"and seeds")
    if runs.eager_baseline is not None:
        baseline_seconds = min(baseline_seconds, totals["ar_eager"][0])
        report["ar_eager_seconds"] = totals["ar_eager"][0]
        print(f"AR uncompiled: {totals['ar_eager'][0]:.2f} s")
    if runs.outside:
        baseline_seconds = min(baseline_seconds, totals["generate"][0])
        print(f"transformers generate() (same target distribution): "
              f"{totals['generate'][0]:.2f} s")
    report.update(ar_seconds=totals["ar"][0], ar_nfe=totals["ar"][1],
                  speedup=baseline_seconds / totals["fast"][0])
    print(f"speed-up over AR: {report['speedup']:.2f}x wall-clock (against the faster AR), "
          f"{totals['ar'][1] / totals['fast'][1]:.2f}x fewer forward passes")
    return report


def check_prompts(model, requests: list) -> None:
    """Start (and drop) a session for every prompt, so that a prompt the model refuses stops
    the run before any image is drawn, not after the ones before it."""
    for request in requests:
        model.start(request)


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point: one line and exit code 2 for a bad prompt or setting."""
    args = parse_args(argv)
    return run_command(PROG, lambda: run(args))


if __name__ == "__main__":
    main()
