"""What a decoding session costs outside the network, and whether that grows with the image.

    python -m sjd_core.tools.bench --cache-scaling [--threads 1]

Times come from forward's ``mark`` callback on the calling thread's CPU clock, which other work
on a busy machine disturbs far less than the wall clock (use ``--threads 1`` so that the thread
does all the work). Two measurements:

1. Cache scaling. A small random Llama decoder through :class:`HFSession`, guided (two rows with
   contexts of different lengths), decodes a whole 16x16 and a whole 64x64 image with the same
   34-node tree every iteration (window 16, 4 candidates, depth 3), keeping three nodes of its
   main path per iteration. The session's time outside the network per iteration (input building
   before the network, what follows it, and ``keep``) should not depend on how long the image is:
   the 64x64 / 16x16 ratio of the medians is printed, with and without row-end tokens (the
   Lumina-mGPT and Emu3 layout, or Janus-Pro's and LlamaGen's). A larger image's network also
   streams more keys and values through the CPU caches and evicts the session's own code and
   data, which makes the same session work slower; so each case is measured again with the
   decoder replaced by a stand-in that only writes keys and values of the decoder's shapes into
   the cache (:class:`CacheWritesOnly`): the session's own work alone, on the same cache sizes.
2. Plain autoregression on the embedded reference model, one image: the session's share of each
   iteration, and the time per token of a greedy loop through the session next to transformers'
   own ``generate()`` on the same network.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..messages import quote
from ..decoding.drafting import DraftTree
from ..decoding.settings import AccelerationSettings
from ..models.hf_session import Context, DecoderParts, HFSession
from ..models.protocol import GenerationRequest
from ..models.reference import WEIGHTS_DIR, ReferenceModel

CODEBOOK, ROW_END, CODES_FROM = 256, 1, 8  # token ids: 0 padding, 1 row end, 2..7 context, codes after
TREE = AccelerationSettings.preset("pac", window=16, pd_candidates=4, pd_depth=3)
KEPT = 3


def random_decoder(seed: int = 0) -> LlamaForCausalLM:
    """A small Llama with random weights (2 layers, width 64): the session's work stands out."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=CODES_FROM + CODEBOOK, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=8192, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def attention_shape(config: LlamaConfig) -> tuple[int, int, int]:
    """(layers, key/value heads, head width) of a decoder with ``config``."""
    return (config.num_hidden_layers, config.num_key_value_heads,
            config.hidden_size // config.num_attention_heads)


class CacheWritesOnly(nn.Module):
    """Stands in for a decoder: writes zero keys and values of its shapes into the cache, layer by
    layer, and returns its inputs as hidden states, so that only the session's own work is left."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.layers, self.heads, self.head_dim = attention_shape(config)

    def forward(self, inputs_embeds: torch.Tensor, cache, **ignored) -> BaseModelOutputWithPast:
        rows, tokens, _ = inputs_embeds.shape
        states = inputs_embeds.new_zeros(rows, self.heads, tokens, self.head_dim)
        for layer in range(self.layers):
            cache.update(states, states, layer)
        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)


class AlsoAttendsLong(nn.Module):
    """A decoder followed, in every forward, by one more attention per layer of its shapes over
    ``columns`` fixed random keys and values (every column open): a longer image's attention
    work behind a session whose own work stays that of its image."""

    def __init__(self, decoder: nn.Module, config: LlamaConfig, rows: int, columns: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.layers, heads, head_dim = attention_shape(config)
        generator = torch.Generator().manual_seed(columns)
        self.keys = torch.randn(rows, heads, columns, head_dim, generator=generator)
        self.values = torch.randn(rows, heads, columns, head_dim, generator=generator)

    def forward(self, inputs_embeds: torch.Tensor, **decoder_inputs) -> BaseModelOutputWithPast:
        out = self.decoder(inputs_embeds=inputs_embeds, **decoder_inputs)
        rows, heads, _, head_dim = self.keys.shape
        queries = inputs_embeds.new_ones(rows, heads, inputs_embeds.shape[1], head_dim)
        for _ in range(self.layers):
            F.scaled_dot_product_attention(queries, self.keys, self.values)
        return out


BACKBONES = ("decoder", "stand-in", "control")
# the image sizes compared; the control attends over as many more columns as the long image's
# codes and row ends
SHORT_SIDE, LONG_SIDE = 16, 64


def decoder_parts(network: LlamaForCausalLM, row_end: bool, backbone: str = "decoder",
                  rows: int = 2) -> DecoderParts:
    """The parts of ``network`` for HFSession. ``backbone`` (one of BACKBONES): its decoder, the
    :class:`CacheWritesOnly` stand-in, or its decoder followed by :class:`AlsoAttendsLong` over
    a LONG_SIDE x LONG_SIDE image's columns (``rows`` cache rows)."""
    if backbone not in BACKBONES:
        raise ValueError(f"backbone is {quote(backbone)}; allowed: {', '.join(BACKBONES)}.")
    embed = network.model.embed_tokens
    if backbone == "decoder":
        layers = network.model
    elif backbone == "stand-in":
        layers = CacheWritesOnly(network.config)
    else:
        columns = LONG_SIDE * (LONG_SIDE + int(row_end))
        layers = AlsoAttendsLong(network.model, network.config, rows, columns)
    return DecoderParts(backbone=layers, embed_tokens=embed,
                        embed_codes=lambda codes: embed(codes + CODES_FROM),
                        code_logits=lambda hidden: network.lm_head(hidden)[..., CODES_FROM:],
                        row_end_id=ROW_END if row_end else None, device=torch.device("cpu"),
                        dtype=torch.float32)


class SplitClock:
    """Splits a forward + keep into the session's time and the network's (thread CPU time)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def mark(self) -> None:
        self.marks.append(time.thread_time())

    def iteration(self, forward, keep) -> tuple[float, float]:
        """(outside, network) seconds of one ``forward()`` then ``keep()``."""
        self.marks.clear()
        start = time.thread_time()
        forward()
        returned = time.thread_time()
        keep()
        done = time.thread_time()
        before, after = self.marks
        return (before - start) + (returned - after) + (done - returned), after - before


@torch.no_grad()
def image_iterations(network: LlamaForCausalLM, side: int, row_end: bool, clock: SplitClock,
                     backbone: str = "decoder") -> tuple[list[float], list[float]]:
    """Per iteration (outside, network) seconds of decoding a whole ``side`` x ``side`` image;
    ``backbone`` as in :func:`decoder_parts`."""
    tree = DraftTree.for_settings(TREE, torch.device("cpu"))
    contexts = [Context(ids=torch.arange(2, 8).repeat(2)), Context(ids=torch.tensor([2, 3, 7]))]
    session = HFSession(decoder_parts(network, row_end, backbone, len(contexts)), contexts[:1],
                        contexts[1:], (side, side), max_nodes=tree.size)
    slots = side * side
    codes = torch.randint(0, CODEBOOK, (1, tree.size), generator=torch.Generator().manual_seed(side))
    path = tree.route[0]
    outside, inside, committed = [], [], 0
    while committed < slots:
        node_slots = (committed - 1 + tree.depth)[None].clamp(max=slots - 1)
        kept = min(KEPT, slots - committed)
        keep = torch.zeros(1, tree.size, dtype=torch.bool)
        keep[0, path[:kept]] = True
        spent = clock.iteration(
            lambda: session.forward(codes, node_slots, tree.ancestors, [committed], mark=clock.mark),
            lambda: session.keep(keep))
        outside.append(spent[0])
        inside.append(spent[1])
        committed += kept
    return outside, inside


def cache_scaling(network: LlamaForCausalLM, repeats: int, rounds: int = 2) -> list[str]:
    """Report lines: outside-the-network time per iteration at 16x16 and 64x64 and their ratio, for
    the decoder and the stand-in, and the control's 16x16 against the decoder's.

    Each round decodes ``repeats`` 16x16 images (about as many iterations as one 64x64 image) and
    one 64x64 image of each case; interleaving them spreads a changing load on the machine over
    all cases.
    """
    cases = [("decoder", SHORT_SIDE), ("decoder", LONG_SIDE), ("stand-in", SHORT_SIDE),
             ("stand-in", LONG_SIDE), ("control", SHORT_SIDE)]
    lines = []
    for row_end in (True, False):
        outside: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
        inside: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
        for _ in range(rounds):
            for backbone, side in cases:
                for _ in range(repeats if side == SHORT_SIDE else 1):
                    o, i = image_iterations(network, side, row_end, SplitClock(), backbone)
                    outside[backbone, side] += o
                    inside[backbone, side] += i
        medians = {case: statistics.median(times) for case, times in outside.items()}
        layout = "row ends" if row_end else "no row ends"
        for backbone, side in cases:
            label = f"{layout}, {backbone}, {side}x{side}"
            if backbone == "control":
                label += f" and attention over {LONG_SIDE}x{LONG_SIDE}'s columns"
            lines.append(f"  {label}: {len(outside[backbone, side])} iterations, outside the network "
                         f"{1e6 * medians[backbone, side]:.0f} us/it, network "
                         f"{1e6 * statistics.median(inside[backbone, side]):.0f} us/it")
            if side == LONG_SIDE:
                lines.append(f"  {layout}, {backbone}: ratio {side}x{side} / {SHORT_SIDE}x{SHORT_SIDE} = "
                             f"{medians[backbone, side] / medians[backbone, SHORT_SIDE]:.2f}")
        lines.append(f"  {layout}, control: ratio to the decoder at {SHORT_SIDE}x{SHORT_SIDE} = "
                     f"{medians['control', SHORT_SIDE] / medians['decoder', SHORT_SIDE]:.2f}")
    return lines


@torch.no_grad()
def autoregression(model: ReferenceModel) -> list[str]:
    """Report lines: the session's share of plain autoregression, and its speed next to generate()."""
    request = GenerationRequest(prompt="sneaker", max_nodes=1)
    slots = model.grid[0] * model.grid[1]
    one = torch.ones(1, 1, dtype=torch.bool)
    clock, outside, inside = SplitClock(), 0.0, 0.0
    session = model.start(request)
    code = torch.zeros(1, 1, dtype=torch.long)
    start = time.thread_time()
    for committed in range(slots):
        logits = []
        spent = clock.iteration(
            lambda: logits.extend(session.forward(code, torch.full((1, 1), committed - 1), one,
                                                  [committed], mark=clock.mark)),
            lambda: session.keep(one))
        outside, inside = outside + spent[0], inside + spent[1]
        code = logits[0].argmax(-1)
    loop = time.thread_time() - start
    prompt = torch.tensor([[model.class_offset + model.class_of("sneaker")]])
    start = time.thread_time()
    model.network.generate(prompt, max_new_tokens=slots, min_new_tokens=slots, do_sample=False,
                           pad_token_id=0)
    generated = time.thread_time() - start
    per = 1e3 / slots
    return [f"  session outside the network: {100 * outside / (outside + inside):.1f}% of forward + keep "
            f"({1e6 * outside / slots:.0f} us of {1e6 * (outside + inside) / slots:.0f} us per token)",
            f"  greedy loop through the session: {loop * per:.2f} ms/token; transformers generate(): "
            f"{generated * per:.2f} ms/token"]


def run(repeats: int = 16) -> str:
    """Both measurements; returns the printed report."""
    network = random_decoder()
    image_iterations(network, 16, True, SplitClock())  # warm up
    lines = ["Session time outside the network per iteration, median (34-node tree, 3 nodes kept, guided):"]
    lines += cache_scaling(network, repeats)
    model = ReferenceModel(WEIGHTS_DIR, device="cpu")
    autoregression(model)  # warm up
    lines += ["Plain autoregression on the reference model (one image, 256 tokens):"] + autoregression(model)
    report = "\n".join(lines)
    print(report)
    return report
