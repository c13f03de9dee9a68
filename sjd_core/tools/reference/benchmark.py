"""Every decoding mode side by side on the embedded reference model, measured in one run.

    python -m sjd_core.tools.reference.benchmark

For each setting (``default``: the model's own sampling recipe; ``high-entropy``: the same at a
higher temperature and without top-p, closer to the flat distributions of real text-to-image
models) it generates
the same images (class ``c`` with seeds ``seed + c * per_class + j``, j < per_class, for each of
the 10 classes, so every image has its own seed)
with every mode and prints one table:

* NFE (forward passes per image), step compression (codes per forward pass), mean accepted
  length, wall-clock speed-up versus AR and the share of time spent outside the forward pass,
  from :func:`sjd_core.tools.bench.measure`;
* the mean entropy and mean top-1 probability of the target distribution along the generated
  images (recomputed by one teacher-forced pass through the same session API);
* the quality probe: classifier accuracy against the requested class and the FID-like feature
  distance to real test images (NOT comparable to published FID; the real-image floor at the
  same image count is printed under the table);
* a two-sample test of each mode's images against AR's (energy distance on the probe's
  features, permutation p-value). For lossless modes the two sets come from the same
  distribution, so small p-values should be as rare as the level says (about 1 in 20 below
  0.05 by chance); for the lossy rows a small p-value is the expected price of the speed.

The targets of the project are checked under the default table, with the measured numbers.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import torch

from ..bench import MODES, format_table, measure
from ...decoding.sampling import entropy, process
from ...decoding.settings import AccelerationSettings, SamplingSettings
from ...models.registry import load_model
from ...models.protocol import GenerationRequest, ImageTokenModel
from ...models.reference.adapter import WEIGHTS_DIR
from .probe import QualityProbe, energy_test, real_floor

COLUMNS = ("mode", "NFE", "step compr.", "mean acc. len", "speed-up", "outside fwd",
           "entropy", "top-1 p", "probe acc.", "feat. dist", "p vs AR")


@torch.inference_mode()
def target_statistics(model: ImageTokenModel, request: GenerationRequest,
                      sampling: SamplingSettings, codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per image: mean entropy (nats) and mean top-1 probability of the target distribution.

    One forward pass feeds each image's own codes as a chain, so output ``i`` is the target of
    slot ``i`` given the image's first ``i`` codes: exactly what the sampler drew from.
    """
    batch, height, width = codes.shape
    n = height * width
    session = model.start(replace(request, batch_size=batch, guidance=sampling.guidance))
    fed = torch.cat([torch.zeros(batch, 1, dtype=torch.long), codes.reshape(batch, n)[:, :-1]], 1)
    slots = torch.arange(-1, n - 1).expand(batch, n)
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    cond, uncond = session.forward(fed, slots, chain, [0] * batch)
    target = process(cond, uncond, sampling)
    return (entropy(target).mean(1).cpu().numpy(),
            target.amax(-1).mean(1).cpu().numpy())


@torch.inference_mode()
def run_setting(model: ImageTokenModel, probe: QualityProbe, sampling: SamplingSettings,
                window: int, per_class: int, seed: int) -> list[dict]:
    """All modes on the same prompts and seeds; one result dict per mode."""
    classes = list(model.classes.names)
    # Distinct seeds for every image: near-uniform targets make a sample mostly a function of
    # its random stream, so one seed shared by several classes would make their images alike
    # and the two-sample test's samples dependent.
    seeds = [[seed + c * per_class + j for j in range(per_class)] for c in range(len(classes))]
    rows, ar_features = [], None
    for label, options in MODES:
        acceleration = AccelerationSettings(**{"window": window, **options})
        parts = [measure(model, GenerationRequest(prompt=name), sampling, acceleration, seeds[c])
                 for c, name in enumerate(classes)]
        codes = torch.cat([part["codes"] for part in parts])
        wanted = np.repeat(np.arange(len(classes)), per_class)
        stats = [target_statistics(model, GenerationRequest(prompt=name), sampling, part["codes"])
                 for name, part in zip(classes, parts)]
        images = model.decode(codes)
        features = probe.features(images)
        quality = probe.evaluate(images, wanted)
        seconds = sum(part["seconds"] for part in parts)
        outside = sum(part["seconds"] * (1 - part["forward_share"]) for part in parts) / seconds
        row = {
            "mode": label, "lossless": acceleration.lossless,
            "nfe": float(np.mean([part["nfe"] for part in parts])),
            "step_compression": float(np.mean([part["step_compression"] for part in parts])),
            "mean_accepted_length": float(np.mean([part["mean_accepted_length"] for part in parts])),
            "seconds": seconds, "outside_forward": outside,
            "entropy": float(np.concatenate([s[0] for s in stats]).mean()),
            "top1": float(np.concatenate([s[1] for s in stats]).mean()),
            "accuracy": quality["accuracy"], "feature_distance": quality["feature_distance"],
        }
        if ar_features is None:
            ar_features, ar_seconds = features, seconds
            row["p_vs_ar"] = None
        else:
            row["p_vs_ar"] = energy_test(ar_features, features, seed=seed)[1]
        row["speedup"] = ar_seconds / seconds
        rows.append(row)
        print(f"  measured {label}: {row['nfe']:.1f} forward passes per image, "
              f"{seconds:.1f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The printed table (via :func:`sjd_core.tools.bench.format_table`)."""
    cells = [{
        "mode": row["mode"] + ("" if row["lossless"] else " (lossy)"),
        "NFE": f"{row['nfe']:.1f}",
        "step compr.": f"{row['step_compression']:.2f}x",
        "mean acc. len": f"{row['mean_accepted_length']:.2f}",
        "speed-up": f"{row['speedup']:.2f}x",
        "outside fwd": f"{100 * row['outside_forward']:.1f}%",
        "entropy": f"{row['entropy']:.2f}",
        "top-1 p": f"{row['top1']:.2f}",
        "probe acc.": f"{100 * row['accuracy']:.0f}%",
        "feat. dist": f"{row['feature_distance']:.2f}",
        "p vs AR": "-" if row["p_vs_ar"] is None else f"{row['p_vs_ar']:.3f}",
    } for row in rows]
    return format_table(cells, COLUMNS)


def targets(rows: list[dict]) -> list[str]:
    """The project's targets on the default setting, each with its measured numbers."""
    by = {row["mode"]: row for row in rows}
    sjd, pac, vp = by["SJD"], by["PAC (SJD+AC+PD)"], by["PAC+VP"]
    ratio = pac["step_compression"] / sjd["step_compression"]
    lossless = [row for row in rows if row["lossless"] and row["p_vs_ar"] is not None]
    worst = min(lossless, key=lambda row: row["p_vs_ar"])
    checks = [
        (ratio >= 1.6, f"PAC step compression >= 1.6x SJD's: {pac['step_compression']:.2f} / "
                       f"{sjd['step_compression']:.2f} = {ratio:.2f}x"),
        (vp["step_compression"] >= pac["step_compression"],
         f"PAC+VP step compression >= PAC's: {vp['step_compression']:.2f} vs "
         f"{pac['step_compression']:.2f}"),
        (worst["p_vs_ar"] >= 0.01,
         f"lossless rows indistinguishable from AR (every p >= 0.01): smallest p = "
         f"{worst['p_vs_ar']:.3f} ({worst['mode']})"),
        (vp["outside_forward"] <= 0.10,
         f"PAC+VP time outside the forward <= 10%: {100 * vp['outside_forward']:.1f}%"),
    ]
    return [f"  [{'met' if ok else 'MISSED'}] {text}" for ok, text in checks]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sjd_core.tools.reference.benchmark",
        description="Benchmark every decoding mode on the embedded reference model (one table per "
                    "setting, all rows measured in one run with the same prompts and seeds).")
    parser.add_argument("--model", default=str(WEIGHTS_DIR), help="reference model folder")
    parser.add_argument("--per-class", type=int, default=5,
                        help="images per class and mode (10 classes; default: %(default)s)")
    parser.add_argument("--window", type=int, default=AccelerationSettings.window,
                        help="window length of every speculative mode (default: %(default)s)")
    parser.add_argument("--high-temperature", type=float, default=1.5,
                        help="temperature of the high-entropy setting, which also turns top-p off "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = parser.parse_args(argv)
    if args.per_class < 2:
        parser.error(f"--per-class={args.per_class} is not allowed: it must be >= 2")
    return args


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    """Run both settings and print their tables; returns the measured rows."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device)
    probe = QualityProbe(args.model)
    base = SamplingSettings(**model.defaults.__dict__)
    settings = {"default": base,
                "high-entropy": replace(base, temperature=args.high_temperature, top_p=1.0)}
    count = 10 * args.per_class
    results = {}
    for name, sampling in settings.items():
        print(f"{name}: {sampling}, window {args.window}, {count} images per mode", flush=True)
        results[name] = run_setting(model, probe, sampling, args.window, args.per_class, args.seed)
    for name, rows in results.items():
        print(f"\n### {name} setting: {settings[name]}, window {args.window}, {count} images per "
              f"mode (10 classes x {args.per_class} seeds)\n")
        print(table(rows))
        print(f"\nmean top-1 probability of the target (AR images): {rows[0]['top1']:.3f}; "
              f"feature distance of {count} real test images (the floor at this count): "
              f"{real_floor(probe, count, seed=args.seed):.2f}")
        if name == "default":
            print("targets:")
            print("\n".join(targets(rows)))
    return results


if __name__ == "__main__":
    main()
