"""Every decoding mode side by side on the embedded reference model, measured in one run.

    python -m sjd_core.tools.reference.benchmark

For each setting (``default``: the model's own sampling recipe; ``high-entropy``: the same at a
higher temperature and without top-p, closer to the flat distributions of real text-to-image
models) it generates
the same images (class ``c`` with seeds ``seed + c * per_class + j``, j < per_class, for each of
the 10 classes, so every image has its own seed)
with every mode, the modes taking turns class by class, and prints one table:

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
Each image shows a progress bar with ETA; a bad setting prints one line and exits with code 2;
torch is imported after the arguments are read, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from ..bench import format_table, measure
from ...command_line import ArgumentParser, run_command
from ..cli import set_threads
from ...decoding.settings import AccelerationSettings, SamplingSettings

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ...models.protocol import GenerationRequest, ImageTokenModel
    from .probe import QualityProbe

PROG = "python -m sjd_core.tools.reference.benchmark"

_ABOVE = dict(init="above_target")
_AC = dict(adaptive_continuation=True)
_PD = dict(proactive_drafting=True)
_VP = dict(verification_prediction=True)
# Each component on its own, then combined; every lossless tree feeds at most 34 nodes.
ABLATION: list[tuple[str, dict]] = [
    ("AR", dict(window=1)),
    ("SJD (window 16)", dict()),
    ("SJD+AC", _AC),
    ("SJD+PD 4x3", _PD),
    ("SJD+VP", _VP),
    ("SJD+above (target)", _ABOVE),
    ("SJD+above (copy)", dict(init="above")),
    ("SJD, window 32", dict(window=32)),
    ("PAC (AC+PD 4x3)", {**_AC, **_PD}),
    ("PAC+VP", {**_AC, **_PD, **_VP}),
    ("AC+above", {**_AC, **_ABOVE}),
    ("AC+above+VP", {**_AC, **_ABOVE, **_VP}),
    ("AC+PD 4x3+above", {**_AC, **_PD, **_ABOVE}),
    ("AC+above, window 34", {**_AC, **_ABOVE, "window": 34}),
    ("AC+PD 2x3+above, window 30", {**_AC, **_ABOVE, **_PD, "window": 30, "pd_candidates": 2}),
    ("AC+PD 4x2+above, window 31", {**_AC, **_ABOVE, **_PD, "window": 31, "pd_depth": 2}),
    ("auto", AccelerationSettings.preset("auto").__dict__),
    ("auto, adaptive tree", {**AccelerationSettings.preset("auto").__dict__,
                             "adaptive_tree": True}),
    ("auto per pass, window 34", {**AccelerationSettings.preset("auto").__dict__,
                                  "shape_cost": "passes", "window": 34}),
    ("auto per pass, adaptive tree", {**AccelerationSettings.preset("auto").__dict__,
                                      "shape_cost": "passes", "window": 34,
                                      "adaptive_tree": True}),
    ("auto+LANTERN", {**AccelerationSettings.preset("auto").__dict__, "relaxed": "lantern"}),
    ("auto+GSD", {**AccelerationSettings.preset("auto").__dict__, "relaxed": "gsd"}),
]
# VP's knobs, tried on the best 16-node base; run only when named with --modes.
VP_VARIANTS: list[tuple[str, dict]] = [
    ("AC+above+VP, N=1", {**_AC, **_ABOVE, **_VP, "vp_rises": 1}),
    ("AC+above+VP, N=2", {**_AC, **_ABOVE, **_VP, "vp_rises": 2}),
    ("AC+above+VP, top-k 5", {**_AC, **_ABOVE, **_VP, "vp_top_k": 5}),
    ("AC+above+VP, decay 0.9", {**_AC, **_ABOVE, **_VP, "vp_decay": 0.9}),
]
WINDOW_SWEEP = (4, 8, 16, 24, 32)  # mean accepted length per window length, AC+above
NODE_BUDGET = 34  # the largest lossless tree of the targets (today's PAC tree)

COLUMNS = ("mode", "nodes", "NFE", "step compr.", "mean acc. len", "speed-up", "outside fwd",
           "entropy", "top-1 p", "probe acc.", "feat. dist", "p vs AR")


def target_statistics(model: ImageTokenModel, request: GenerationRequest,
                      sampling: SamplingSettings, codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per image: mean entropy (nats) and mean top-1 probability of the target distribution.

    One forward pass feeds each image's own codes as a chain, so output ``i`` is the target of
    slot ``i`` given the image's first ``i`` codes: exactly what the sampler drew from.
    """
    import torch

    from ...decoding.guidance import SlotGuidance
    from ...decoding.sampling import entropy, process

    with torch.inference_mode():
        batch, height, width = codes.shape
        n = height * width
        session = model.start(replace(request, batch_size=batch, guidance=sampling.guidance))
        fed = torch.cat([torch.zeros(batch, 1, dtype=torch.long), codes.reshape(batch, n)[:, :-1]], 1)
        slots = torch.arange(-1, n - 1).expand(batch, n)
        chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
        cond, uncond = session.forward(fed, slots, chain, [0] * batch)
        target = process(cond, uncond, sampling,
                         SlotGuidance(sampling, height, width, cond.device)
                         .after(slots.to(cond.device)))
        return (entropy(target).mean(1).cpu().numpy(),
                target.amax(-1).mean(1).cpu().numpy())


def run_setting(model: ImageTokenModel, probe: QualityProbe, sampling: SamplingSettings,
                per_class: int, seed: int, modes: list[tuple[str, dict]] = ABLATION
                ) -> list[dict]:
    """The ablation rows ``modes`` (AR first) on the same prompts and seeds; one result dict per
    row."""
    from ...models.protocol import GenerationRequest
    from .probe import energy_test

    classes = list(model.classes.names)
    # Distinct seeds for every image: near-uniform targets make a sample mostly a function of
    # its random stream, so one seed shared by several classes would make their images alike
    # and the two-sample test's samples dependent.
    seeds = [[seed + c * per_class + j for j in range(per_class)] for c in range(len(classes))]
    settings = [(label, AccelerationSettings(**options)) for label, options in modes]
    measured: dict[str, list[dict]] = {label: [] for label, _ in settings}
    # The modes take turns, class by class, so that a change in the machine's load during the
    # run reaches every mode alike and the speed-ups stay comparable.
    # VP's rows also count how well its rises predicted (a dozen operations an iteration, in
    # their time)
    for c, name in enumerate(classes):
        for label, acceleration in settings:
            measured[label].append(measure(model, GenerationRequest(prompt=name), sampling,
                                           acceleration, seeds[c], count_vp_rises=True))
        print(f"  measured every mode on {name}", flush=True)
    rows, ar_features = [], None
    for label, acceleration in settings:
        row, features = _row(model, probe, sampling, label, acceleration, measured[label],
                             per_class)
        if ar_features is None:
            ar_features, ar_seconds = features, row["seconds"]
            row["p_vs_ar"] = None
        else:
            row["p_vs_ar"] = energy_test(ar_features, features, seed=seed)[1]
        row["speedup"] = ar_seconds / row["seconds"]
        rows.append(row)
    return rows


def _row(model: ImageTokenModel, probe: QualityProbe, sampling: SamplingSettings, label: str,
         acceleration: AccelerationSettings, parts: list[dict], per_class: int
         ) -> tuple[dict, object]:
    """One mode's table row from its measured parts (one per class), and the probe's features
    of its images (for the test against AR's)."""
    import numpy as np
    import torch

    from ...decoding.planner import largest_shape
    from ...decoding.trace import RISE_COUNTS
    from ...models.protocol import GenerationRequest

    classes = list(model.classes.names)
    codes = torch.cat([part["codes"] for part in parts])
    wanted = np.repeat(np.arange(len(classes)), per_class)
    stats = [target_statistics(model, GenerationRequest(prompt=name), sampling, part["codes"])
             for name, part in zip(classes, parts)]
    images = model.decode(codes)
    quality = probe.evaluate(images, wanted)
    seconds = sum(part["seconds"] for part in parts)
    outside = sum(part["seconds"] * (1 - part["forward_share"]) for part in parts) / seconds
    summaries = [summary for part in parts for summary in part["summaries"]]
    row = {
        "mode": label, "lossless": acceleration.lossless,
        "nodes": largest_shape(acceleration),
        "nfe": float(np.mean([part["nfe"] for part in parts])),
        "step_compression": float(np.mean([part["step_compression"] for part in parts])),
        "mean_accepted_length": float(np.mean([part["mean_accepted_length"] for part in parts])),
        "seconds": seconds, "outside_forward": outside,
        "entropy": float(np.concatenate([s[0] for s in stats]).mean()),
        "top1": float(np.concatenate([s[1] for s in stats]).mean()),
        "accuracy": quality["accuracy"], "feature_distance": quality["feature_distance"],
        "drafts": {name: (sum(summary["drafts_tested"][name] for summary in summaries),
                          sum(summary["draft_sources"][name] for summary in summaries))
                   for name in summaries[0]["drafts_tested"]},
        "shapes": sum((Counter(summary["shapes"]) for summary in summaries), Counter()),
        "vp_rises": {name: sum(summary["vp_rises"].get(name, 0) for summary in summaries)
                     for name in RISE_COUNTS},
    }
    return row, probe.features(images)


def table(rows: list[dict]) -> str:
    """The printed table (via :func:`sjd_core.tools.bench.format_table`)."""
    cells = [{
        "mode": row["mode"] + ("" if row["lossless"] else " (lossy)"),
        "nodes": str(row["nodes"]),
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


def draft_rules(rows: list[dict]) -> str:
    """For the rows with VP or an above rule: how often the test that decided a committed slot
    passed, by the rule that made the draft (passed / tested). PD siblings are left out: a
    sibling decides a slot only when it passes (after a rejected sibling the slot's residual
    draw is recorded with the first candidate's rule)."""
    from ...decoding.drafting import DRAFT_SOURCES, PD_SIBLING

    lines = []
    for row in rows:
        if "VP" not in row["mode"] and "above" not in row["mode"]:
            continue
        parts = [f"{name} {passed}/{tested} ({100 * passed / tested:.0f}%)"
                 for name, (tested, passed) in row["drafts"].items()
                 if tested and name != DRAFT_SOURCES[PD_SIBLING]]
        lines.append(f"  {row['mode']}: " + "; ".join(parts))
    return "\n".join(lines)


def shapes_fed(rows: list[dict]) -> str:
    """For the rows that fed more than one shape (``auto``): iterations per shape, most first."""
    from ...decoding.trace import shape_counts_text

    return "\n".join(f"  {row['mode']}: {shape_counts_text(row['shapes'])}"
                     for row in rows if len(row["shapes"]) > 1)


def vp_rises(rows: list[dict]) -> str:
    """For the rows with VP: how well a consecutive rise predicted the committed code, over the
    committed slots whose probabilities VP had followed for at least one iteration."""
    lines = []
    for row in rows:
        counts = row["vp_rises"]
        if not counts["slots"]:
            continue
        some = counts["some_code_rose"]
        lines.append(
            f"  {row['mode']}: of {counts['slots']} slots, the committed code had risen in "
            f"{100 * counts['committed_code_rose'] / counts['slots']:.1f}%; some code had "
            f"risen in {100 * some / counts['slots']:.1f}%, and there the likeliest riser was "
            f"the committed code in {100 * counts['likeliest_riser_committed'] / max(some, 1):.1f}%")
    return "\n".join(lines)


def window_sweep(model: ImageTokenModel, sampling: SamplingSettings, per_class: int,
                 seed: int) -> list[dict]:
    """Mean accepted length and step compression of AC+above per window length."""
    from ...models.protocol import GenerationRequest

    rows = []
    for window in WINDOW_SWEEP:
        acceleration = AccelerationSettings(window=window, **_AC, **_ABOVE)
        parts = [measure(model, GenerationRequest(prompt=name), sampling, acceleration,
                         [seed + c * per_class + j for j in range(per_class)])
                 for c, name in enumerate(model.classes.names)]
        rows.append({"window": window,
                     "mean_accepted_length": sum(p["mean_accepted_length"] for p in parts) / len(parts),
                     "step_compression": sum(p["step_compression"] for p in parts) / len(parts)})
    return rows


def targets(name: str, rows: list[dict]) -> list[str]:
    """The project's targets for one setting, each with its measured numbers."""
    wanted = {"default": 4.4, "high-entropy": 5.5}[name]
    exact = [row for row in rows if row["lossless"] and row["mode"] != "AR"
             and row["nodes"] <= NODE_BUDGET]
    lossless = [row for row in rows if row["lossless"] and row["p_vs_ar"] is not None]
    checks = []
    if exact:
        best = max(exact, key=lambda row: row["step_compression"])
        checks.append((best["step_compression"] >= wanted,
                       f"an exact mode of at most {NODE_BUDGET} nodes needs >= {wanted}x fewer "
                       f"forward passes than AR: {best['step_compression']:.2f}x ({best['mode']}, "
                       f"{best['nodes']} nodes)"))
    if lossless:
        worst = min(lossless, key=lambda row: row["p_vs_ar"])
        checks.append((worst["p_vs_ar"] >= 0.01,
                       f"lossless rows indistinguishable from AR (every p >= 0.01): smallest p = "
                       f"{worst['p_vs_ar']:.3f} ({worst['mode']})"))
    return [f"  [{'met' if ok else 'MISSED'}] {text}" for ok, text in checks]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog=PROG,
        description="Benchmark every decoding mode on the embedded reference model (one table per "
                    "setting, all rows measured in one run with the same prompts and seeds).")
    parser.add_argument("--model", default=None,
                        help="reference model folder (default: the embedded one)")
    parser.add_argument("--per-class", type=int, default=5,
                        help="images per class and mode (10 classes; default: %(default)s)")
    parser.add_argument("--high-temperature", type=float, default=1.5,
                        help="temperature of the high-entropy setting, which also turns top-p off "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default: %(default)s)")
    parser.add_argument("--modes", default=None,
                        help="only these rows, by their names in the table separated by ';' (AR "
                             "always runs first, as the baseline; the window sweep is left out); "
                             "also VP's variants, run only when named: "
                             + "; ".join(label for label, _ in VP_VARIANTS)
                             + " (default: every row of the table)")
    parser.add_argument("--device", default="cpu", help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (default 0: the usable cores, at most 4)")
    args = parser.parse_args(argv)
    if args.per_class < 2:
        parser.error(f"--per-class={args.per_class} is not allowed: it must be >= 2")
    if args.modes is not None:
        names = [name.strip() for name in args.modes.split(";") if name.strip()]
        known = [label for label, _ in ABLATION + VP_VARIANTS]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            parser.error(f"--modes={args.modes!r} is not allowed: name rows of the table, "
                         f"separated by ';', from {known}")
        args.modes = [ABLATION[0]] + [row for row in ABLATION[1:] + VP_VARIANTS
                                      if row[0] in names]
    return args


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    """Run both settings and print their tables; returns the measured rows. A bad setting prints
    one line and exits with code 2."""
    args = parse_args(argv)
    return run_command(PROG, lambda: _run(args))


def _run(args: argparse.Namespace) -> dict[str, list[dict]]:
    import torch

    with torch.inference_mode():
        return _run_settings(args)


def _run_settings(args: argparse.Namespace) -> dict[str, list[dict]]:
    from ...models.reference.adapter import WEIGHTS_DIR
    from ...models.registry import load_model
    from .probe import QualityProbe

    threads = set_threads(args.threads)
    print(f"torch CPU threads: {threads} (--threads to change)", flush=True)
    model = load_model(args.model or WEIGHTS_DIR, device=args.device)
    probe = QualityProbe(args.model or WEIGHTS_DIR)
    recipe = model.defaults
    base = SamplingSettings.of_recipe(recipe)
    settings = {"default": base,
                "high-entropy": replace(base, temperature=args.high_temperature, top_p=1.0)}
    count = 10 * args.per_class
    results, sweeps = {}, {}
    for name, sampling in settings.items():
        print(f"{name}: {sampling}, {count} images per mode", flush=True)
        results[name] = run_setting(model, probe, sampling, args.per_class, args.seed,
                                    args.modes or ABLATION)
        sweeps[name] = ([] if args.modes else
                        window_sweep(model, sampling, args.per_class, args.seed))
    for name, rows in results.items():
        _print_setting(name, settings[name], rows, sweeps[name], probe, args)
    return results


def _print_setting(name: str, sampling: SamplingSettings, rows: list[dict], sweep: list[dict],
                   probe: QualityProbe, args: argparse.Namespace) -> None:
    """One setting's table, its draft rules, shapes, VP rises, window sweep and targets."""
    from .probe import real_floor

    count = 10 * args.per_class
    print(f"\n### {name} setting: {sampling}, {count} images per mode (10 classes x "
          f"{args.per_class} seeds)\n")
    print(table(rows))
    print(f"\nmean top-1 probability of the target (AR images): {rows[0]['top1']:.3f}; "
          f"feature distance of {count} real test images (the floor at this count): "
          f"{real_floor(probe, count, seed=args.seed):.2f}")
    print("\ndecisive tests passed, by the rule that made the draft:")
    print(draft_rules(rows))
    if any(len(row["shapes"]) > 1 for row in rows):
        print("\niterations by the shape fed:")
        print(shapes_fed(rows))
    if any(row["vp_rises"]["slots"] for row in rows):
        print("\nVP's consecutive rises (the rise count of the slot's last draft) against the "
              "committed code:")
        print(vp_rises(rows))
    if sweep:
        print("\nAC+above by window length: " + ", ".join(
            f"window {row['window']}: mean accepted length "
            f"{row['mean_accepted_length']:.2f} ({row['step_compression']:.2f}x)"
            for row in sweep))
    print("targets:")
    print("\n".join(targets(name, rows)))


if __name__ == "__main__":
    main()
