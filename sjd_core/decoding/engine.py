"""The decoding loop: draft -> forward -> verify -> commit, one iteration at a time.

One loop serves every mode: ``window=1`` is plain autoregression (the fed node is the last
committed code and its output is sampled), larger windows are speculative Jacobi decoding, and AC,
PD, VP and relaxed acceptance change only how drafts are made (``drafting``) and tested
(``verify``). Per iteration the loop reads one small tensor back from the device: the number of
slots each row has committed, which decides when to stop and feeds progress reports.

Batches: each row has its own random stream (seed + row) and commits its own number of slots per
iteration. All rows feed the same node shape every iteration; a row that has finished keeps
feeding padding until the slowest row is done. That is the cost of the simple scheme: a batch
takes as many forward passes as its slowest image, and finished rows still occupy the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .drafting import (DraftTree, WindowState, add_candidates, empty_history, initial_drafts,
                       redraft, shift_window)
from ..models.protocol import GenerationRequest, ImageTokenModel
from .sampling import RowRandom, process
from .settings import AccelerationSettings, SamplingSettings
from .trace import Trace, TraceRecorder
from .verify import FORCED, RELAXED, acceptance_rule, verify_tree

_FORCED_MASS = 1.0 - 1e-6


@dataclass
class IterationReport:
    """Progress after one iteration, for progress bars, previews and interruption."""

    iteration: int
    committed: list[int]  # slots committed so far, per row
    accepted: list[int]  # slots committed by this iteration, per row
    total: int  # slots per image
    codes: torch.Tensor  # (B, total) on the model's device; row b is valid up to committed[b]


@dataclass
class GenerationResult:
    """Generated code grids (B, H, W) on the CPU and the trace of how they were made."""

    codes: torch.Tensor
    trace: Trace


@torch.no_grad()
def generate(model: ImageTokenModel, request: GenerationRequest, sampling: SamplingSettings,
             acceleration: AccelerationSettings, seed: int,
             on_iteration: Callable[[IterationReport], None] | None = None) -> GenerationResult:
    """Generate ``request.batch_size`` code grids; row b uses random seed ``seed + b``.

    ``on_iteration`` is called after every iteration and may raise to stop (the exception
    propagates; the model itself is left usable). Runs without autograd.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63 - 2**16:
        raise ValueError(f"seed={seed!r} is not allowed: seed must be an integer in [0, 2**63 - 65536).")
    if not isinstance(request.batch_size, int) or request.batch_size < 1:
        raise ValueError(f"batch_size={request.batch_size!r} is not allowed: batch_size must be "
                         "an integer >= 1.")
    device = torch.device(model.device)
    session = model.start(replace(request, guidance=sampling.guidance))
    batch, height, width = session.batch_size, session.grid_height, session.grid_width
    slots, vocab, window = height * width, model.codebook_size, acceleration.window

    tree = DraftTree.build(acceleration, device)
    rule = acceptance_rule(acceleration,
                           None if acceleration.lossless else model.codebook_embeddings().to(device))
    random = RowRandom([seed + row for row in range(batch)], device)
    recorder = TraceRecorder(batch, slots, device)

    codes = torch.zeros(batch, slots + 1, dtype=torch.long, device=device)
    committed = torch.zeros(batch, dtype=torch.long, device=device)
    anchor = torch.zeros(batch, dtype=torch.long, device=device)
    offsets = torch.arange(window, device=device)
    node_ids = torch.arange(tree.size, device=device)
    everything = torch.ones(batch, window, dtype=torch.bool, device=device)
    tokens, q = initial_drafts(
        acceleration.init, anchor, torch.zeros(batch, window, dtype=torch.long, device=device),
        torch.zeros(batch, window, vocab, device=device), everything, committed, width,
        random.exponential(window, vocab))
    state = WindowState(tokens, q, *(empty_history(batch, window, vocab, device)
                                     if acceleration.verification_prediction else ()))

    done = [0] * batch
    iteration = 0
    while min(done) < slots:
        recorder.clock.mark()
        node_tokens, node_valid = add_candidates(
            state, tree, random.exponential(tree.tree_levels, vocab) if tree.tree_levels else None)
        node_tokens[:, 0] = anchor
        node_slots = ((committed - 1)[:, None] + tree.depth).clamp_max(slots - 1)
        cond, uncond = session.forward(node_tokens, node_slots, tree.ancestors, committed=done)
        recorder.clock.mark()

        target = process(cond, uncond, sampling)
        verdict = verify_tree(tree, target, node_tokens, node_valid, state.q,
                              random.uniform(tree.size, tree.branching), random.exponential(vocab),
                              rule)
        count = torch.minimum(verdict.accepted + 1, slots - committed)
        along_path = target.gather(1, verdict.path[..., None].expand(-1, -1, vocab))
        forced = (along_path.amax(-1) >= _FORCED_MASS) & (verdict.kinds != RELAXED)
        kinds = torch.where(forced, FORCED, verdict.kinds)

        window_slots = committed[:, None] + offsets
        writes = torch.where(offsets < count[:, None], window_slots, slots)
        codes.scatter_(1, writes, verdict.tokens)
        recorder.entered_window(iteration, torch.where(window_slots < slots, window_slots, slots))
        recorder.committed_slots(iteration, writes, count, kinds, verdict.probability)

        on_path = verdict.path.gather(1, tree.depth.expand(batch, -1)) == node_ids
        session.keep(on_path & (tree.depth < count[:, None]))

        committed = committed + count
        anchor = codes.gather(1, (committed - 1).clamp_min(0)[:, None]).squeeze(1)
        shifted, has_target = shift_window(state, count)
        stale = along_path.gather(1, (offsets + count[:, None]).clamp_max(window - 1)[..., None]
                                  .expand(-1, -1, vocab))
        noise = random.exponential(window, vocab)
        tokens, q, state = redraft(shifted, stale, has_target, acceleration,
                                   random.uniform(window), noise)
        state.tokens, state.q = initial_drafts(acceleration.init, anchor, tokens, q, ~has_target,
                                               committed, width, noise)
        recorder.clock.mark()

        previous, done = done, committed.tolist()
        iteration += 1
        if on_iteration is not None:
            on_iteration(IterationReport(iteration, done, [b - a for a, b in zip(previous, done)],
                                         slots, codes[:, :slots]))

    meta = {"mode": acceleration.mode_name, "lossless": acceleration.lossless,
            "window": window, "tree_nodes": tree.size, "seed": seed,
            "family": getattr(model, "family", "?"), "codebook_size": vocab,
            "acceleration": acceleration.__dict__.copy(), "sampling": sampling.__dict__.copy()}
    trace = recorder.finish((height, width), meta)
    return GenerationResult(codes[:, :slots].reshape(batch, height, width).cpu(), trace)
