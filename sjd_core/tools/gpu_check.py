"""Time the decoding on a randomly initialised model of real size: one command, one GPU, one table.

    python -m sjd_core.tools.gpu_check                 # Lumina-mGPT 7B layout, 768 px, bf16, CUDA
    python -m sjd_core.tools.gpu_check --json out.json # the table as JSON too
    python -m sjd_core.tools.gpu_check --tiny          # the same layout at toy width, on the CPU

The model has Lumina-mGPT 7B's shape (32 layers, width 4096, the 65,536-token vocabulary with its
8,192 image codes) with random weights, guidance on (a conditional and an unconditional row).
Random weights say nothing about acceptance; the table measures costs:

* the network's time for 1 fed token against 16, 34 (the PAC tree) and 64 nodes;
* plain autoregression (the lean step): milliseconds per code;
* PAC+VP and auto: milliseconds per iteration and codes per iteration;
* the share of each run's time spent outside the network, timed with the session's marks around
  the network (CUDA events, no synchronisation);
* host reads per iteration (every value read back from the device), and peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ..decoding.drafting import DraftTree
from ..decoding.engine import generate
from ..decoding.settings import AccelerationSettings, SamplingSettings
from ..decoding.trace import Clock
from ..models.chameleon import (LUMINA, ChameleonImageModel, TokenLayout, lumina_resolutions,
                                synthetic_vocabulary)
from ..models.protocol import GenerationRequest
from ..models.vqgan import VQGANConfig, VQGANDecoder

PROMPT = "a photograph of a red fox sitting in fresh snow at dawn, soft light, high detail"
RESOLUTION = (768, 768)


@dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    vqgan: VQGANConfig
    vq_encoder: dict | None = None  # transformers' ChameleonVQVAEConfig fields (None: the real one)


REAL = Size(hidden=4096, intermediate=11008, layers=32, heads=32, vocab=65536,  # Chameleon 7B
            vqgan=VQGANConfig())
TINY = Size(hidden=64, intermediate=128, layers=2, heads=4, vocab=9000,
            vqgan=VQGANConfig(embed_dim=8, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                              resolution=32),
            vq_encoder={"embed_dim": 8, "latent_channels": 8, "base_channels": 32,
                        "channel_multiplier": [1, 2], "num_res_blocks": 1, "resolution": 32})


class _WordTokenizer:
    """Whitespace words -> one unknown-token id each: prompt length without tokenizer files."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3] * len(text.split())}


class HostReads(TorchFunctionMode):
    """Counts tensor operations that read values back to the host (or depend on them).

    numpy's view of a tensor counts only off the CPU: a CPU tensor's memory is the host's (the
    CPU's top-p sorts there with numpy), and another device's cannot be viewed at all.
    """

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
             "masked_select", "unique", "argwhere", "__len__"}
    VIEWS = {"numpy", "__array__"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        boolean_index = name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flatten(args[1:]))
        moves_to_host = name == "to" and any(str(a).startswith("cpu") for a in args[1:])
        viewed_off_the_cpu = name in self.VIEWS and args[0].device.type != "cpu"
        if name in self.READS or boolean_index or moves_to_host or viewed_off_the_cpu:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _flatten(items):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flatten(item)
        else:
            yield item


def build_model(size: Size, device: torch.device, dtype: torch.dtype) -> ChameleonImageModel:
    """A Lumina-mGPT-layout model with random weights, built directly on ``device``."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    vocab = synthetic_vocabulary(8192)
    config = ChameleonConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
        max_position_embeddings=4096, vocabulary_map=vocab, bos_token_id=0, eos_token_id=2,
        pad_token_id=1, vq_config=size.vq_encoder)
    config._attn_implementation = "sdpa"
    with init_empty_weights(include_buffers=False):  # parameters empty, buffers real
        model = ChameleonForConditionalGeneration(config)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, p in list(model.named_parameters()):
        value = torch.empty(p.shape, dtype=dtype, device=device)
        if "norm" in name:  # layer norms: identity (weight 1, bias 0)
            value.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            value.normal_(0.0, 0.02, generator=generator)
        set_module_tensor_to_device(model, name, device, value=value)
    model.to(device)
    vqgan = VQGANDecoder(size.vqgan).to(device).eval()
    resolutions = lumina_resolutions(768)
    layout = TokenLayout.read(vocab, LUMINA, resolutions)
    return ChameleonImageModel(LUMINA, model.eval(), _WordTokenizer(), vqgan, resolutions, layout)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model: ChameleonImageModel, tree: DraftTree, repeats: int) -> float:
    """Median seconds of one guided forward (cond + uncond rows) feeding ``tree`` after the
    prefill (each forward thrown away again)."""
    request = GenerationRequest(prompt=PROMPT, guidance=3.0, resolution=RESOLUTION,
                                max_nodes=tree.size)
    session = model.start(request)
    dev = model.device
    codes = torch.randint(0, model.codebook_size, (1, tree.size), device=dev)
    slots = (tree.depth - 1)[None]
    keep_none = torch.zeros(1, tree.size, dtype=torch.bool, device=dev)
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        _sync(dev)
        start = time.perf_counter()
        session.forward(codes, slots, tree.ancestors, [0])
        _sync(dev)
        times.append(time.perf_counter() - start)
        session.keep(keep_none)
    return statistics.median(times[1:])


class _NetworkClock(Clock):
    """Sums the network's time from the marks a session makes around it (no synchronisation:
    CUDA events, read once at the end; perf_counter on the CPU)."""

    def seconds(self) -> float:
        pairs = list(zip(self.marks[::2], self.marks[1::2]))
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
        return sum(b - a for a, b in pairs)


class _Marked:
    """The model, with each session's network marks also going to a :class:`_NetworkClock`."""

    def __init__(self, model: ChameleonImageModel, clock: _NetworkClock) -> None:
        self.model, self.clock = model, clock

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def start(self, request: GenerationRequest):
        session, clock = self.model.start(request), self.clock
        forward, advance = session.forward, session.advance

        def both(mark) -> Callable[[], None]:
            def marks() -> None:
                clock.mark()
                if mark is not None:
                    mark()
            return marks

        advancing = []  # an advance that takes forward + keep marks once, in advance

        def marked_forward(codes, slots, ancestors, committed, mark=None):
            return forward(codes, slots, ancestors, committed, mark if advancing else both(mark))

        def marked_advance(codes, committed, mark=None):  # plain autoregression's step
            advancing.append(True)
            try:
                return advance(codes, committed, both(mark))
            finally:
                advancing.pop()

        session.forward, session.advance = marked_forward, marked_advance
        return session


class _Stop(Exception):
    pass


def run_mode(model: ChameleonImageModel, preset: str, iterations: int) -> dict:
    """``iterations`` engine iterations of ``preset`` (guided, 768 px) after the prefill: time
    per iteration, codes per iteration, the share outside the network, host reads."""
    clock = _NetworkClock(model.device)
    marked, reads, seen = _Marked(model, clock), HostReads(), {}

    def stop(report) -> None:
        if report.iteration == 1:  # measured from here: prefill and first iteration done
            _sync(model.device)
            seen.update(start=time.perf_counter(), reads=reads.count, marks=len(clock.marks),
                        committed=report.committed[0])
        elif report.iteration == iterations + 1:
            seen.update(committed_end=report.committed[0], reads_end=reads.count,
                        marks_end=len(clock.marks))
            raise _Stop

    sampling = SamplingSettings(guidance=3.0, temperature=1.0, top_k=2000)
    request = GenerationRequest(prompt=PROMPT, resolution=RESOLUTION)
    try:
        with reads:
            generate(marked, request, sampling, AccelerationSettings.preset(preset), seed=0,
                     on_iteration=stop)
    except _Stop:
        pass
    _sync(model.device)
    loop = time.perf_counter() - seen["start"]
    clock.marks = clock.marks[seen["marks"]:seen["marks_end"]]
    network = clock.seconds()
    return {"mode": preset, "iterations": iterations,
            "ms_per_iteration": 1e3 * loop / iterations,
            "codes_per_iteration": (seen["committed_end"] - seen["committed"]) / iterations,
            "outside_share": max(0.0, 1 - network / loop),
            "host_reads_per_iteration": (seen["reads_end"] - seen["reads"]) / iterations}


def measure(size: Size, device: torch.device, dtype: torch.dtype, iterations: int,
            repeats: int) -> dict:
    """Every number of the table."""
    built = time.perf_counter()
    model = build_model(size, device, dtype)
    table = {"model": f"Lumina-mGPT layout, {size.layers} layers x {size.hidden}, "
                      f"{str(dtype).removeprefix('torch.')}, {device}, 768 px, guidance on",
             "build_seconds": time.perf_counter() - built}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    shapes = {"1 token": DraftTree.build(1, (), device),
              "16-node window": DraftTree.build(16, (), device),
              "34-node PAC tree": DraftTree.build(16, (4, 4), device),
              "64-node window": DraftTree.build(64, (), device)}
    table["forward_ms"] = {name: 1e3 * time_forward(model, tree, repeats)
                           for name, tree in shapes.items()}
    table["runs"] = [run_mode(model, preset, iterations) for preset in ("ar", "pac+vp", "auto")]
    table["ar_ms_per_code"] = table["runs"][0]["ms_per_iteration"]
    table["peak_memory_gib"] = (torch.cuda.max_memory_allocated(device) / 2**30
                                if device.type == "cuda" else None)
    return table


def format_table(table: dict) -> str:
    lines = [f"model: {table['model']} (built in {table['build_seconds']:.1f} s)", "",
             "| forward (network) | ms | x 1 token |", "| --- | ---: | ---: |"]
    one = table["forward_ms"]["1 token"]
    lines += [f"| {name} | {ms:.2f} | {ms / one:.2f} |" for name, ms in table["forward_ms"].items()]
    lines += ["", "| mode | ms / iteration | codes / iteration | outside the network | "
                  "host reads / iteration |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['mode']} | {r['ms_per_iteration']:.2f} | {r['codes_per_iteration']:.2f} | "
              f"{100 * r['outside_share']:.1f}% | {r['host_reads_per_iteration']:.2f} |"
              for r in table["runs"]]
    lines += ["", f"plain autoregression: {table['ar_ms_per_code']:.2f} ms per code"]
    if table["peak_memory_gib"] is not None:
        lines.append(f"peak memory: {table['peak_memory_gib']:.1f} GiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sjd_core.tools.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy width on the CPU (a smoke test)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="engine iterations per mode (default 48 real, 6 tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats of each forward")
    parser.add_argument("--json", default=None, help="also write the table to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny:
        device, dtype, size = torch.device("cpu"), torch.float32, TINY
        torch.set_num_threads(1)  # toy sizes gain nothing from threads; leave the other cores be
    else:
        if not torch.cuda.is_available():
            print("No CUDA device: run with --tiny for the CPU smoke test.", file=sys.stderr)
            return 2
        device, dtype, size = torch.device("cuda"), torch.bfloat16, REAL
    table = measure(size, device, dtype, args.iterations or (6 if args.tiny else 48),
                    args.repeats or (2 if args.tiny else 10))
    print(format_table(table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(table, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
