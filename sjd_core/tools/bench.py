"""Wall-clock speed of every lossless mode side by side, measured in one run with paired images.

    python -m sjd_core.tools.bench --threads 1                       # the embedded reference model
    python -m sjd_core.tools.bench --model synthetic --images 1      # a random 48x48 model
    python -m sjd_core.tools.bench --threads 1 --batch 4 --json bench.json
    python -m sjd_core.tools.bench --cache-scaling --threads 1       # the session's own cost
    python -m sjd_core.tools.bench --threads 1 --compile             # compiled, and eager AR
    python -m sjd_core.tools.bench --threads 1 --compile --compile-stages  # + stages compiled
    python -m sjd_core.tools.bench --threads 1 --batch 4 --windows 4,8    # + AC+above at 4 and 8

For every image (prompt and seed) each mode runs once, one after the other, so a busy machine
slows all of them alike; the table gives, per mode, forward passes and seconds per image, the
speed-up against plain autoregression (AR), step compression and the share of the time spent
outside the network. On the reference model transformers' own ``generate()`` (with its
classifier-free guidance, temperature and top-p: the same target distribution) runs too, as an
outside reference; every speed-up is against the faster of the ARs. With ``--compile`` every mode
runs its network compiled, after one untimed first image per mode whose seconds (compiling
included) are printed, and AR also runs uncompiled (``AR eager``). A progress bar with ETA
follows each image; a bad setting prints one line and exits with code 2. ``--cache-scaling``
measures the decoding session's own cost instead (see :mod:`.session_bench`). ``measure`` and
``format_table`` are shared with the reference-model benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..messages import quote
from ..decoding.settings import AccelerationSettings, SamplingSettings
from ..command_line import ArgumentParser, device_name, new_file, non_negative_int, run_command
from .cli import ImageProgress, set_threads

if TYPE_CHECKING:
    from ..models.protocol import GenerationRequest, ImageTokenModel

PROG = "python -m sjd_core.tools.bench"

MODES: dict[str, AccelerationSettings] = {
    "AR": AccelerationSettings.preset("ar"),
    "SJD": AccelerationSettings.preset("sjd"),
    "SJD+AC": AccelerationSettings(adaptive_continuation=True),
    "PAC": AccelerationSettings.preset("pac"),
    "PAC+VP": AccelerationSettings.preset("pac+vp"),
    # the fastest fixed lossless mode of the reference benchmark: what auto is held to
    "AC+above": AccelerationSettings(init="above_target", adaptive_continuation=True),
    "auto": AccelerationSettings.preset("auto"),
}
GENERATE = "transformers generate()"
EAGER_AR = "AR eager"  # with --compile: plain autoregression uncompiled, a baseline too
COLUMNS = ["mode", "NFE/image", "s/image", "speed-up", "step compr.", "outside net"]


@dataclass
class ModeTimes:
    """What one mode did over the images: seconds, forward passes and network time per image."""

    seconds: list[float] = field(default_factory=list)
    nfe: list[float] = field(default_factory=list)
    network: list[float] = field(default_factory=list)

    def add(self, seconds: float, nfe: float, network: float) -> None:
        self.seconds.append(seconds)
        self.nfe.append(nfe)
        self.network.append(network)


def timed(model: ImageTokenModel, request: GenerationRequest, sampling: SamplingSettings,
          acceleration: AccelerationSettings, seed: int, count_vp_rises: bool = False):
    """``generate`` with a progress bar; returns the result and its wall-clock seconds."""
    from ..decoding.engine import generate

    bar = ImageProgress(f"{acceleration.mode_name} {quote(request.prompt)} seed {seed}")
    start = time.perf_counter()
    try:
        result = generate(model, request, sampling, acceleration, seed=seed, on_iteration=bar,
                          count_vp_rises=count_vp_rises)
    finally:
        bar.close()
    return result, time.perf_counter() - start


def measure(model: ImageTokenModel, request: GenerationRequest, sampling: SamplingSettings,
            acceleration: AccelerationSettings, seeds: Sequence[int],
            count_vp_rises: bool = False) -> dict:
    """Generate one batch per seed and time the whole calls.

    Returns codes (N, H, W), wall ``seconds`` (prefill and set-up included), ``forward_share``
    of that time spent in the network, and the mean NFE, step compression and accepted length
    over the images. ``count_vp_rises`` as in ``generate`` (its work is timed with the rest).
    """
    import numpy as np
    import torch

    codes, summaries, seconds = [], [], 0.0
    for seed in seeds:
        result, spent = timed(model, request, sampling, acceleration, seed, count_vp_rises)
        seconds += spent
        codes.append(result.codes)
        summaries.append(result.trace.summary())
    forward = sum(s["forward_seconds"] for s in summaries)
    return {
        "codes": torch.cat(codes),
        "summaries": summaries,
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


def transformers_generate(model: ImageTokenModel, prompt: str, batch: int,
                          sampling: SamplingSettings, seed: int) -> float:
    """Seconds for transformers' ``generate()`` to draw ``batch`` reference-model images.

    Same target distribution as the pack's: classifier-free guidance against the null class on
    raw logits (generate's guidance works on log-softmaxed logits, which differs by a constant
    per row and so gives the same softmax), class tokens suppressed, then temperature, top-k,
    top-p. Only the embedded reference model (a plain ``LlamaForCausalLM``) runs this way.
    """
    import torch

    net, codes = model.network, model.codebook_size
    token = model.class_offset + model.class_of(prompt) if prompt else model.null_token
    ids = torch.full((batch, 1), token, device=model.device)
    negative = torch.full((batch, 1), model.null_token, device=model.device)
    return generate_seconds(net, ids, negative, sampling, model.grid[0] * model.grid[1], seed,
                            pad_token_id=model.null_token,
                            suppress_tokens=list(range(codes, net.config.vocab_size)))


def generate_seconds(network, ids, negative_ids, sampling: SamplingSettings, new_tokens: int,
                     seed: int, pad_token_id: int, suppress_tokens: list[int] | None = None
                     ) -> float:
    """Seconds (synchronised) of one transformers ``generate()`` call on ``network`` drawing
    exactly ``new_tokens`` after ``ids`` with the pack's sampling: guidance against
    ``negative_ids`` (generate's own, which runs the unconditional context as a second forward
    per token), temperature, top-k, top-p; in inference mode, as the pack's own loop runs."""
    import torch

    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        network.generate(ids, attention_mask=torch.ones_like(ids), negative_prompt_ids=negative_ids,
                         guidance_scale=sampling.guidance, do_sample=True,
                         temperature=sampling.temperature, top_k=sampling.top_k or None,
                         top_p=sampling.top_p, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, suppress_tokens=suppress_tokens,
                         pad_token_id=pad_token_id, eos_token_id=None)
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - start


def run(model: ImageTokenModel, modes: dict[str, AccelerationSettings],
        sampling: SamplingSettings, prompts: Sequence[str], batch: int, seed: int,
        with_generate: bool, progress: Callable[[str], None] = print) -> dict[str, ModeTimes]:
    """Every mode on every prompt (one batch each, seeds ``seed + i * batch``), interleaved."""
    from ..models.protocol import GenerationRequest

    times = {name: ModeTimes() for name in ([GENERATE] if with_generate else []) + list(modes)}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        image_seed = seed + index * batch
        if with_generate:
            seconds = transformers_generate(model, prompt, batch, sampling, image_seed)
            times[GENERATE].add(seconds, float(model.grid[0] * model.grid[1]), float("nan"))
        for name, acceleration in modes.items():
            request = GenerationRequest(prompt=prompt, batch_size=batch)
            result, seconds = timed(model, request, sampling, acceleration, image_seed)
            summary = result.trace.summary()
            times[name].add(seconds, summary["nfe"], summary["forward_seconds"])
        done = index + 1
        elapsed = time.perf_counter() - started
        line = ", ".join(f"{name} {t.seconds[-1]:.2f} s" for name, t in times.items())
        progress(f"  image {done}/{len(prompts)} ({line}); ETA "
                 f"{elapsed / done * (len(prompts) - done):.0f} s")
    return times


def compile_first_images(model: ImageTokenModel, modes: dict[str, AccelerationSettings],
                         sampling: SamplingSettings, prompt: str, batch: int, seed: int) -> None:
    """One untimed batch per compiled mode, so that the timed images do not pay for compiling;
    prints each one's seconds (compiling included) and how its compiling went."""
    from ..models.protocol import GenerationRequest

    for name, acceleration in modes.items():
        if not acceleration.compile:
            continue
        result, seconds = timed(model, GenerationRequest(prompt=prompt, batch_size=batch),
                                sampling, acceleration, seed)
        report, stages = result.trace.meta["compile"], result.trace.meta.get("compile_stages")
        print(f"{name} first compiled image: {seconds:.1f} s ({report['compiled_shapes']} "
              f"shape(s) compiled, {report['eager_shapes']} uncompiled"
              + (f"; stages: {stages['graphs']} graphs" if stages else "") + ")"
              + "".join(f"; WARNING: {r['failure']}" for r in (report, stages or {})
                        if r.get("failure")), flush=True)


def fastest_ar(times: dict[str, ModeTimes]) -> str | None:
    """The plain autoregression run (ours, uncompiled, or generate's) of the lowest median
    seconds; None where the run has none."""
    ars = [name for name in ("AR", EAGER_AR, GENERATE) if name in times]
    return min(ars, key=lambda name: statistics.median(times[name].seconds), default=None)


def summarise(times: dict[str, ModeTimes], slots: int, batch: int) -> list[dict]:
    """One record per mode; speed-ups against the faster AR (ours or generate's), by medians."""
    baseline = statistics.median(times[fastest_ar(times)].seconds)
    records = []
    for name, t in times.items():
        seconds = statistics.median(t.seconds)
        nfe = statistics.mean(t.nfe)
        records.append({
            "mode": name,
            "nfe_per_image": nfe,
            "seconds_per_image": seconds / batch,
            "speedup_vs_ar": baseline / seconds,
            "step_compression": slots / nfe,
            # generate() runs outside the session, so its network time is not marked (null);
            # the median image's share, as for the seconds: an image that compiled a shape
            # spent seconds outside the network that the others did not
            "outside_forward_share": (None if name == GENERATE else statistics.median(
                1 - network / seconds for network, seconds in zip(t.network, t.seconds))),
        })
    return records


def against_fixed(records: list[dict], modes: dict[str, AccelerationSettings]) -> str:
    """A line comparing every ``auto`` row's speed with the fastest fixed lossless mode's."""
    speed = {r["mode"]: r["speedup_vs_ar"] for r in records}
    fixed = [name for name, settings in modes.items()
             if settings.lossless and not settings.adaptive_shape]
    cost_aware = [name for name, settings in modes.items() if settings.adaptive_shape]
    if not fixed or not cost_aware:
        return "auto / fastest fixed lossless mode: not measured (the run lacks one of the two)"
    best = max(fixed, key=speed.__getitem__)
    return "; ".join(f"{name} / fastest fixed lossless mode ({best}): {speed[name] / speed[best]:.3f}"
                     for name in cost_aware)


def against_ar_by_image(times: dict[str, ModeTimes],
                        modes: dict[str, AccelerationSettings]) -> str:
    """A line per ``auto`` row: its speed against the faster AR, image by image (paired: the same
    prompt and seed), and the mean over the images after the first and over all of them (the
    first carries what ``auto`` learns before anything is known)."""
    fastest = fastest_ar(times)
    cost_aware = [name for name, settings in modes.items() if settings.adaptive_shape]
    if fastest is None or not cost_aware:
        return "auto / AR by image: not measured (the run lacks one of the two)"
    lines = []
    for name in cost_aware:
        ratios = [ar / own for ar, own in zip(times[fastest].seconds, times[name].seconds)]
        later = f"{statistics.mean(ratios[1:]):.3f}" if len(ratios) > 1 else "-"
        lines.append(f"{name} / {fastest} by image: {', '.join(f'{r:.2f}' for r in ratios)}; "
                     f"mean {later} after the first image, {statistics.mean(ratios):.3f} with it")
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    return format_table([{
        "mode": r["mode"], "NFE/image": f"{r['nfe_per_image']:.1f}",
        "s/image": f"{r['seconds_per_image']:.3f}", "speed-up": f"{r['speedup_vs_ar']:.2f}x",
        "step compr.": f"{r['step_compression']:.2f}x",
        "outside net": "-" if r["outside_forward_share"] is None
        else f"{100 * r['outside_forward_share']:.1f}%",
    } for r in records], COLUMNS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="reference",
                        help="'reference' (the embedded model), 'synthetic' (a random 48x48 "
                             "model) or a checkpoint folder (default: %(default)s)")
    parser.add_argument("--images", type=int, default=10,
                        help="prompts (batches) per mode (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="images per batch (default: 1)")
    parser.add_argument("--setting", choices=("default", "hot"), default="default",
                        help="the model's recipe, or 'hot': temperature 1.5 without top-p")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated modes (default: all: {','.join(MODES)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, type=new_file,
                        help="also write the records to this file")
    parser.add_argument("--device", default=None, type=device_name,
                        help="default: CUDA if present, else CPU")
    parser.add_argument("--threads", type=non_negative_int, default=0,
                        help="CPU threads for torch (default 0: the usable cores, at most 4); 1 "
                             "keeps timings steady on a machine that is busy with other work")
    parser.add_argument("--compile", action="store_true",
                        help="run every mode's network compiled (torch.compile), plus AR "
                             "uncompiled as a baseline; prints each mode's first image, which "
                             "compiles, before timing")
    parser.add_argument("--compile-stages", action="store_true",
                        help="with --compile: also run every mode with its decoding stages "
                             "compiled (compile_stages=True), as '<mode> + stages'")
    parser.add_argument("--windows", type=window_lengths, default=(),
                        help="comma-separated window lengths: also run AC+above with each, as "
                             "'AC+above, window N', fixed lossless modes that auto is held to "
                             "like the others (e.g. 4,8: shorter windows can pay more where a "
                             "forward's cost grows with the tokens fed, as at batch 4 on a CPU)")
    parser.add_argument("--cache-scaling", action="store_true",
                        help="measure the session's time outside the network per iteration at a "
                             "16x16 and a 64x64 grid instead of comparing modes")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        parser.error(f"--modes={quote(args.modes)} is not allowed: {unknown} are not modes; pick "
                     f"from {list(MODES)}")
    if args.compile_stages and not args.compile:
        parser.error("--compile-stages is not allowed without --compile: the rows it adds are "
                     "held to the compiled modes")
    for flag in ("images", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)} is not allowed: it must be >= 1")
    return args


def window_lengths(text: str) -> tuple[int, ...]:
    """argparse type of ``--windows``: comma-separated integers >= 2."""
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 2:
        raise argparse.ArgumentTypeError(f"{quote(text)} is not allowed: it must be window "
                                         "lengths (integers >= 2) separated by commas, e.g. 4,8")
    return lengths


def load(name: str, device: str) -> tuple[ImageTokenModel, list[str]]:
    """The model and the prompts it cycles through."""
    if name == "synthetic":
        from ..models.synthetic import SyntheticModel

        model = SyntheticModel(codebook_size=8192, grid=(48, 48), width=256, layers=4, heads=4,
                               sharpness=3.0, seed=0, device=device)
        return model, ["a red fox in the snow"]
    from ..models.reference import WEIGHTS_DIR
    from ..models.registry import load_model

    model = load_model(WEIGHTS_DIR if name == "reference" else name, device=device)
    names = list(getattr(getattr(model, "classes", None), "names", [])) or ["a photo"]
    return model, names


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Command-line entry point: one line and exit code 2 for a bad setting."""
    args = parse_args(argv)
    return run_command(PROG, lambda: _run(args))


def _run(args: argparse.Namespace) -> list[dict]:
    import torch

    from ..decoding.engine import check_batch
    from ..models.protocol import GenerationRequest

    threads = set_threads(args.threads)
    if args.cache_scaling:
        from . import session_bench

        return session_bench.run()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, names = load(args.model, device)
    recipe = model.defaults
    sampling = SamplingSettings.of_recipe(recipe)
    if args.setting == "hot":
        sampling = SamplingSettings.of_recipe(recipe, temperature=1.5, top_p=1.0)
    prompts = [names[i % len(names)] for i in range(args.images)]
    chosen = {name: MODES[name] for name in args.modes.split(",")}
    chosen.update({f"AC+above, window {window}": replace(MODES["AC+above"], window=window)
                   for window in args.windows})
    modes = {name: replace(settings, compile=args.compile) for name, settings in chosen.items()}
    if args.compile_stages:
        modes.update({f"{name} + stages": replace(settings, compile_stages=True)
                      for name, settings in list(modes.items())})
    if args.compile:
        modes[EAGER_AR] = replace(MODES["AR"], compile=False)
    for acceleration in modes.values():  # before any mode (or generate()) runs a batch
        check_batch(model, GenerationRequest(prompt=prompts[0], batch_size=args.batch), sampling,
                    acceleration)
    with_generate = getattr(model, "family", "") == "reference"
    print(f"{args.model} model, {device}, {threads} torch CPU thread(s), {sampling}, "
          f"{args.images} batch(es) of {args.batch} per mode", flush=True)
    if args.compile:
        compile_first_images(model, modes, sampling, prompts[0], args.batch, args.seed)
    times = run(model, modes, sampling, prompts, args.batch, args.seed, with_generate,
                progress=lambda line: print(line, flush=True))
    height, width = model.grid_for(None)
    records = summarise(times, height * width, args.batch)
    print(table(records))
    if with_generate and "AR" in times:
        ours, theirs = (statistics.median(times[n].seconds) for n in ("AR", GENERATE))
        print(f"AR (ours) / generate(): ratio of medians {ours / theirs:.3f}")
    print(against_fixed(records, modes))
    print(against_ar_by_image(times, modes))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(records, handle, indent=1, allow_nan=False)
    return records


if __name__ == "__main__":
    main()
