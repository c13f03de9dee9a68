"""Checks every transformers-based family adapter passes, each against plain full forwards (fp32).

A family test supplies ``reference(codes, row)``: the model's code logits after the slot -1 token
and after each of ``codes`` (shape ``(len(codes) + 1, codebook)``), computed by ONE ordinary
causal forward over the whole sequence of the family's recipe (``row`` is ``"cond"`` or
``"uncond"``). The adapter's session must reproduce those numbers however the slots are fed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from sjd_core.decoding.engine import generate
from sjd_core.models.protocol import GenerationRequest
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings

Reference = Callable[[list[int], str], torch.Tensor]
TOL = dict(atol=1e-4, rtol=1e-4)


def chain(t: int) -> torch.Tensor:
    return torch.tril(torch.ones(t, t, dtype=torch.bool))


@torch.no_grad()
def check_window_equals_stepwise(model, request: GenerationRequest, reference: Reference,
                                 codes: list[int]) -> None:
    """A window of slots -1..n-2 in one forward == one slot per forward == the reference."""
    n = len(codes)
    ref = reference(codes, "cond")[:n]
    session = model.start(request)
    window, _ = session.forward(torch.tensor([[0] + codes[:-1]]), torch.arange(-1, n - 1)[None], chain(n),
                                [0])
    torch.testing.assert_close(window[0], ref, **TOL)
    session = model.start(request)
    steps = []
    for slot in range(-1, n - 1):
        out, _ = session.forward(torch.tensor([[0 if slot < 0 else codes[slot]]]), torch.tensor([[slot]]),
                                 chain(1), [slot + 1])
        session.keep(torch.ones(1, 1, dtype=torch.bool))
        steps.append(out[0, 0])
    torch.testing.assert_close(torch.stack(steps), ref, **TOL)


@torch.no_grad()
def check_tree_equals_branches(model, request: GenerationRequest, reference: Reference,
                               codes: list[int], start: int) -> None:
    """A draft tree fed with its ancestor mask == each branch fed alone (reference forwards).

    ``codes[:start]`` are committed first; the tree then holds two candidates for slot ``start``,
    a child under each for ``start + 1`` and a grandchild under the first branch.
    """
    session = model.start(request)
    session.forward(torch.tensor([[0] + codes[:start]]), torch.arange(-1, start)[None], chain(start + 1), [0])
    session.keep(torch.ones(1, start + 1, dtype=torch.bool))
    a, b, x, y, z = codes[start], codes[start + 1], codes[start + 2], codes[start + 3], codes[start + 4]
    tree_codes = torch.tensor([[a, b, x, y, z]])
    slots = torch.tensor([[start, start, start + 1, start + 1, start + 2]])
    ancestors = torch.eye(5, dtype=torch.bool)
    ancestors[2, 0] = ancestors[3, 1] = ancestors[4, 2] = ancestors[4, 0] = True
    out, _ = session.forward(tree_codes, slots, ancestors, [start + 1])
    branches = {0: [a], 1: [b], 2: [a, x], 3: [b, y], 4: [a, x, z]}
    for node, branch in branches.items():
        ref = reference(codes[:start] + branch, "cond")[-1]
        torch.testing.assert_close(out[0, node], ref, **TOL)


@torch.no_grad()
def check_keep_path_then_continue(model, request: GenerationRequest, reference: Reference,
                                  codes: list[int]) -> None:
    """Keep a tree's accepted path, continue: the next forward equals a fresh full forward."""
    session = model.start(request)
    wrong = [(c + 1) % model.codebook_size for c in codes]
    # nodes: slot -1, 0, 1 (chain); slot 2: right / wrong; slot 3 under each of them
    node_codes = torch.tensor([[0, codes[0], codes[1], wrong[2], codes[2], wrong[3], codes[3]]])
    slots = torch.tensor([[-1, 0, 1, 2, 2, 3, 3]])
    anc = torch.zeros(7, 7, dtype=torch.bool)
    anc[:3, :3] = chain(3)
    anc[3:, :3] = True
    anc[3, 3] = anc[4, 4] = anc[5, 5] = anc[6, 6] = True
    anc[5, 3] = True  # (3, wrong) under (2, wrong)
    anc[6, 4] = True  # (3, right) under (2, right)
    session.forward(node_codes, slots, anc, [0])
    session.keep(torch.tensor([[True, True, True, False, True, False, True]]))
    out, _ = session.forward(torch.tensor([codes[4:7]]), torch.tensor([[4, 5, 6]]), chain(3), [5])
    torch.testing.assert_close(out[0], reference(codes[:7], "cond")[5:8], **TOL)


@torch.no_grad()
def check_batched_guidance(model, request: GenerationRequest, reference: Reference,
                           rows: list[list[int]]) -> None:
    """One batched forward of conditional + unconditional rows == separate reference forwards."""
    session = model.start(request)
    assert session.guided and session.batch_size == len(rows)
    n = len(rows[0])
    cond, uncond = session.forward(torch.tensor([[0] + r[:-1] for r in rows]),
                                   torch.arange(-1, n - 1).expand(len(rows), n), chain(n), [0] * len(rows))
    for b, r in enumerate(rows):
        torch.testing.assert_close(cond[b], reference(r, "cond")[:n], **TOL)
        torch.testing.assert_close(uncond[b], reference(r, "uncond")[:n], **TOL)


def _window(session, seqs: list[list[int]], cached: list[int], width: int):
    """Feed each row a chain of ``width`` nodes from its first uncached slot ``cached[b]``."""
    last = session.grid_height * session.grid_width - 1
    slots = torch.stack([torch.arange(c, c + width) for c in cached]).clamp(max=last)
    codes = torch.tensor([[0 if s < 0 else seq[s] for s in row.tolist()] for seq, row in zip(seqs, slots)])
    return session.forward(codes, slots, chain(width), [c + 1 for c in cached])


def _keep_first(session, take: list[int], width: int) -> None:
    session.keep(torch.arange(width)[None, :] < torch.tensor(take)[:, None])


@torch.no_grad()
def check_retain_and_probe(model, request: GenerationRequest, codes: list[int], width: int = 5) -> None:
    """Three guided rows drift apart, a probe forward is thrown away, rows 0 and 2 are retained:
    from then on their outputs equal those of a session that only ever had rows 0 and 2 (the
    forward after the probe is narrower, so the probe's last columns must be closed again)."""
    assert request.batch_size == 3 and request.guidance != 1.0
    seqs = [codes[i:] + codes[:i] for i in (0, 3, 7)]
    whole, alone = model.start(request), model.start(replace(request, batch_size=2))
    cached = [-1, -1, -1]
    for take in ([3, 5, 2], [2, 1, 4]):
        _window(whole, seqs, cached, width)
        _window(alone, [seqs[0], seqs[2]], [cached[0], cached[2]], width)
        _keep_first(whole, take, width)
        _keep_first(alone, [take[0], take[2]], width)
        cached = [c + k for c, k in zip(cached, take)]
    _window(whole, seqs[::-1], cached, width)  # a probe, thrown away
    _keep_first(whole, [0, 0, 0], width)
    whole.retain([0, 2])
    assert whole.batch_size == 2
    for got, want in zip(*(_window(session, [seqs[0], seqs[2]], [cached[0], cached[2]], width - 2)
                           for session in (whole, alone))):
        torch.testing.assert_close(got, want, **TOL)


LOSSLESS_MODES = {
    "sjd": AccelerationSettings(window=5),
    "sjd-left-init": AccelerationSettings(window=5, init="left"),
    "sjd+ac": AccelerationSettings(window=5, adaptive_continuation=True),
    "pac": AccelerationSettings.preset("pac", window=5, pd_candidates=3, pd_depth=3),
    "pac+vp": AccelerationSettings.preset("pac+vp", window=5, pd_candidates=3, pd_depth=3, vp_top_k=8),
    "sjd+ac-above-target-init": AccelerationSettings(window=5, adaptive_continuation=True,
                                                     init="above_target"),
    "sjd-above-init": AccelerationSettings(window=5, init="above"),
    "auto": AccelerationSettings.preset("auto", window=5),
}


class _Enough(Exception):
    """Stops a run once the compared slots are committed."""


def first_codes(model, request: GenerationRequest, sampling: SamplingSettings,
                acceleration: AccelerationSettings, slots: int | None = None, seed: int = 0
                ) -> tuple[torch.Tensor, int]:
    """(B, slots) codes of the first ``slots`` slots of every image (all when None) and the
    iterations it took to commit them."""
    seen = {}

    def stop(report):
        seen["iterations"] = report.iteration
        if slots is not None and min(report.committed) >= slots:
            seen["codes"] = report.codes[:, :slots].cpu().clone()
            raise _Enough

    try:
        result = generate(model, request, sampling, acceleration, seed=seed, on_iteration=stop)
    except _Enough:
        return seen["codes"], seen["iterations"]
    return result.codes.flatten(1)[:, :slots], seen["iterations"]


def check_greedy_modes_agree(model, request: GenerationRequest, guidance: float,
                             slots: int | None = None,
                             guidance_schedule: str = "constant") -> dict[str, int]:
    """Greedy (top-k 1) codes are identical in AR and every lossless mode, on the first ``slots``
    slots of each image (all when None); returns the iterations each mode needed for them."""
    sampling = SamplingSettings(guidance=guidance, top_k=1, guidance_schedule=guidance_schedule)
    ar, forwards = first_codes(model, request, sampling, AccelerationSettings(window=1), slots)
    iterations = {"ar": forwards}
    for name, acceleration in LOSSLESS_MODES.items():
        codes, iterations[name] = first_codes(model, request, sampling, acceleration, slots)
        assert torch.equal(codes, ar), f"{name} codes differ from AR"
    return iterations


def autoregressive_codes_and_logits(model, request: GenerationRequest, sampling: SamplingSettings,
                                    seed: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, slots) codes of AR's first ``slots`` slots and the (B, slots, codebook) conditional
    logits each was drawn from, as the session returned them."""
    logits: list[torch.Tensor] = []
    start = model.start

    def recording_start(request: GenerationRequest):
        session = start(request)
        advance = session.advance

        def recording_advance(*args, **kwargs):
            cond, uncond = advance(*args, **kwargs)
            logits.append(cond.detach().cpu().clone())
            return cond, uncond

        session.advance = recording_advance
        return session

    model.start = recording_start
    try:
        codes, _ = first_codes(model, request, sampling, AccelerationSettings(window=1), slots, seed)
    finally:
        model.start = start
    return codes, torch.stack(logits[:slots], dim=1)


def check_batch_rows_follow_their_streams(model, request: GenerationRequest,
                                          sampling: SamplingSettings, seed: int, slots: int,
                                          agreeing: int) -> list[tuple[int, float]]:
    """Row b of an AR batch against seed + b generated alone, over the first ``slots`` slots.

    The same random stream: the codes agree on at least the first ``agreeing`` slots (where a
    draw can flip only when a ~1e-5 logit difference straddles its uniform). The model's
    distribution: up to the first slot where the codes differ, the batched logits equal the
    single ones within ``TOL``. Returns per row that first differing slot (``slots`` when none)
    and the largest logit difference before it."""
    batch_codes, batch_logits = autoregressive_codes_and_logits(model, request, sampling, seed, slots)
    found = []
    for row in range(request.batch_size):
        alone = replace(request, batch_size=1)
        codes, logits = autoregressive_codes_and_logits(model, alone, sampling, seed + row, slots)
        differ = (batch_codes[row] != codes[0]).nonzero()
        first = int(differ[0]) if len(differ) else slots
        assert first >= agreeing, f"row {row}: codes differ from seed {seed + row} alone at slot {first}"
        torch.testing.assert_close(batch_logits[row, :first + 1], logits[0, :first + 1], **TOL)
        found.append((first, float((batch_logits[row, :first + 1] - logits[0, :first + 1]).abs().max())))
    return found


def check_relaxed_modes_run(model, request: GenerationRequest, guidance: float) -> None:
    """LANTERN and GSD (lossy) run on the family's codebook embeddings and give in-range codes."""
    embeddings = model.codebook_embeddings()
    assert embeddings.shape[0] == model.codebook_size and embeddings.dtype == torch.float32
    sampling = SamplingSettings(guidance=guidance, top_k=8)
    for relaxed in ("lantern", "gsd"):
        acceleration = AccelerationSettings.preset("pac+vp", window=5, pd_depth=3, relaxed=relaxed,
                                                   lantern_neighbours=4)
        codes = generate(model, request, sampling, acceleration, seed=1).codes
        grid = model.grid_for(request.resolution)
        assert codes.shape == (request.batch_size, *grid)
        assert int(codes.min()) >= 0 and int(codes.max()) < model.codebook_size


def check_offloaded_model_agrees(model, offloaded, request: GenerationRequest, guidance: float) -> None:
    """A model with layers offloaded by a ``device_map`` gives the same greedy codes, in PAC+VP too."""
    sampling = SamplingSettings(guidance=guidance, top_k=1)
    ar = generate(model, request, sampling, AccelerationSettings(window=1), seed=0).codes
    assert any(place == "disk" for place in offloaded.model.hf_device_map.values())
    for acceleration in (AccelerationSettings(window=1), LOSSLESS_MODES["pac+vp"]):
        assert torch.equal(generate(offloaded, request, sampling, acceleration, seed=0).codes, ar)


def check_decode(model, grid: tuple[int, int], pixels: tuple[int, int]) -> None:
    """decode: (B, H, W) codes -> (B, height, width, 3) float32 in [0, 1]."""
    codes = torch.randint(0, model.codebook_size, (2, *grid), generator=torch.Generator().manual_seed(0))
    images = model.decode(codes)
    assert images.shape == (2, pixels[1], pixels[0], 3)
    assert images.dtype == torch.float32
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    assert float(images.std()) > 0.0


def output_positions(prefix: int, count: int, width: int, row_end: bool) -> list[int]:
    """Sequence index of the output for slot -1 and each of ``count`` codes after a prefix."""
    positions, pos = [prefix - 1], prefix - 1
    for i in range(count):
        pos += 1 + (1 if row_end and i % width == width - 1 else 0)
        positions.append(pos)
    return positions


@torch.no_grad()
def check_text_without_letters_is_read_as_a_prompt(model, request: GenerationRequest) -> None:
    """A text family reads a prompt of punctuation and emoji as text: the session is conditioned
    on it (not unconditional, and its first logits are not those of the empty prompt)."""
    first = {}
    for prompt in ("", "!!! \U0001f98a"):
        session = model.start(replace(request, prompt=prompt))
        assert not getattr(session, "unconditional", False)
        logits, _ = session.forward(torch.tensor([[0]]), torch.tensor([[-1]]), chain(1), [0])
        first[prompt] = logits[0, 0]
    assert not torch.allclose(first[""], first["!!! \U0001f98a"])
