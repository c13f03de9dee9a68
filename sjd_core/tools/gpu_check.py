"""Time the decoding core on a randomly initialised model of real size (one command, one GPU).

    python -m sjd_core.tools.gpu_check            # Lumina-mGPT 7B layout, 768 px, bf16, CUDA
    python -m sjd_core.tools.gpu_check --tiny     # the same layout at toy width, on the CPU

Prints the time of a 1-token forward, a 64-slot window forward (crossing row ends), a proactive
drafting tree forward (K=4 candidates, depth 3, plus the chain to the window), then runs AR and
PAC+VP for a fixed number of iterations and splits their time into the model's forward, the
cache compaction (``keep``) and everything else the engine does (drafting, verification,
bookkeeping). Random weights say nothing about acceptance rates; this measures costs per
iteration only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..decoding.engine import generate
from ..decoding.drafting import DraftTree
from ..models.chameleon import (LUMINA, ChameleonImageModel, TokenLayout, lumina_resolutions,
                                synthetic_vocabulary)
from ..models.protocol import GenerationRequest
from ..models.vqgan import VQGANConfig, VQGANDecoder
from ..decoding.settings import AccelerationSettings, SamplingSettings


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


def time_forward(model: ChameleonImageModel, slots: torch.Tensor, ancestors: torch.Tensor,
                 repeats: int) -> float:
    """Median seconds of one guided forward (cond + uncond rows) feeding ``slots`` from a prefix."""
    session = model.start(GenerationRequest(prompt=PROMPT, guidance=3.0, resolution=(768, 768)))
    dev = model.device
    codes = torch.randint(0, model.codebook_size, slots.shape, device=dev)
    keep_none = torch.zeros(slots.shape, dtype=torch.bool, device=dev)
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        _sync(dev)
        start = time.perf_counter()
        session.forward(codes, slots, ancestors, [0])
        _sync(dev)
        times.append(time.perf_counter() - start)
        session.keep(keep_none)
    return statistics.median(times[1:])


class _Timed:
    """Wraps a model so its sessions add up prefill, forward and keep seconds (synchronised)."""

    def __init__(self, model: ChameleonImageModel) -> None:
        self.model, self.prefill_s, self.forward_s, self.keep_s = model, 0.0, 0.0, 0.0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def start(self, request: GenerationRequest):
        _sync(self.model.device)
        start = time.perf_counter()
        session, outer = self.model.start(request), self
        _sync(self.model.device)
        self.prefill_s += time.perf_counter() - start
        forward, keep = session.forward, session.keep

        def timed(fn, attr):
            def run(*args, **kwargs):
                _sync(outer.model.device)
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                _sync(outer.model.device)
                setattr(outer, attr, getattr(outer, attr) + time.perf_counter() - start)
                return out
            return run

        session.forward, session.keep = timed(forward, "forward_s"), timed(keep, "keep_s")
        return session


class _Stop(Exception):
    pass


def run_engine(model: ChameleonImageModel, preset: str, iterations: int) -> dict:
    """Run ``iterations`` engine iterations of ``preset`` (guided, 768 px); split the time."""
    timed = _Timed(model)
    committed = []

    def stop(report) -> None:
        committed[:] = report.committed
        if report.iteration >= iterations:
            raise _Stop

    sampling = SamplingSettings(guidance=3.0, temperature=1.0, top_k=2000)
    request = GenerationRequest(prompt=PROMPT, resolution=(768, 768))
    _sync(model.device)
    start = time.perf_counter()
    try:
        generate(timed, request, sampling, AccelerationSettings.preset(preset), seed=0, on_iteration=stop)
    except _Stop:
        pass
    _sync(model.device)
    total = time.perf_counter() - start
    loop = total - timed.prefill_s
    return {"iterations": iterations, "committed": committed[0], "prefill_s": timed.prefill_s,
            "loop_s": loop, "forward_s": timed.forward_s, "keep_s": timed.keep_s,
            "engine_s": loop - timed.forward_s - timed.keep_s}


PROMPT = "a photograph of a red fox sitting in fresh snow at dawn, soft light, high detail"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy width on the CPU (a smoke test)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="engine iterations per mode (default 64 real, 8 tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats of each forward")
    args = parser.parse_args(argv)
    if args.tiny:
        device, dtype, size = torch.device("cpu"), torch.float32, TINY
        torch.set_num_threads(1)  # toy sizes gain nothing from threads; leave the other cores be
    else:
        if not torch.cuda.is_available():
            print("No CUDA device: run with --tiny for the CPU smoke test.", file=sys.stderr)
            return 2
        device, dtype, size = torch.device("cuda"), torch.bfloat16, REAL
    iterations = args.iterations or (8 if args.tiny else 64)
    repeats = args.repeats or (3 if args.tiny else 10)

    built = time.perf_counter()
    model = build_model(size, device, dtype)
    print(f"model: Lumina-mGPT layout, {size.layers} layers x {size.hidden}, {dtype}, {device}, "
          f"768 px (48x48 codes + 48 row ends), guidance on (2 rows); built in "
          f"{time.perf_counter() - built:.1f} s")
    if device.type == "cuda":
        print(f"memory after build: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB")

    chain = lambda t: torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))  # noqa: E731
    one = time_forward(model, torch.tensor([[-1]], device=device), chain(1), repeats)
    window = time_forward(model, torch.arange(-1, 63, device=device)[None], chain(64), repeats)
    tree = DraftTree.build(16, 4, 3, device)
    pd = time_forward(model, (tree.depth - 1)[None], tree.ancestors, repeats)
    print(f"forward, 1 token:            {one * 1e3:8.2f} ms")
    print(f"forward, 64-slot window:     {window * 1e3:8.2f} ms")
    print(f"forward, PD tree ({tree.size} nodes): {pd * 1e3:8.2f} ms  (K=4, depth 3, chain to 16)")
    for preset in ("ar", "pac+vp"):
        r = run_engine(model, preset, iterations)
        per = 1e3 / r["iterations"]
        print(f"{preset:7s} {r['iterations']} iterations, {r['committed']} slots committed "
              f"(prefill {r['prefill_s'] * 1e3:.1f} ms): "
              f"loop {r['loop_s'] * per:7.2f} ms/it = forward {r['forward_s'] * per:7.2f} + "
              f"keep {r['keep_s'] * per:6.2f} + engine outside the forward {r['engine_s'] * per:6.2f}")
    if device.type == "cuda":
        print(f"peak memory: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
