"""The session's own work per iteration is a fixed, small number of tensor operations.

Counted with a dispatch-level counter on the embedded reference model (guided, one image), in the
middle of an image: the operations of ``forward`` + ``keep`` outside the network (between the two
``mark`` calls the network runs and is not counted), and separately the operations the cache does
inside the network (writing each layer's new keys and values, reading views of them). The pinned
counts leave a small margin; a change that adds work to every iteration fails here. The session
benchmark (``bench --cache-scaling``) that times the same work runs here at toy size.
"""

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sjd_core.decoding.drafting import DraftTree
from sjd_core.decoding.settings import AccelerationSettings
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.reference import WEIGHTS_DIR, ReferenceModel
from sjd_core.tools import session_bench

MARGIN = 2
# (session operations outside the network, cache operations inside it) per forward + keep;
# pac's keep moves only as many columns as a path holds (a clamp and two slices), one selection
# and one copy for all layers at once. Every forward attends through the mask at the cache's full
# capacity (static shapes): the mask takes one scatter for the fed block and one when it settles,
# plain autoregression's too, and each layer's keys and values one indexed write each
PINNED = {"ar": (27, 18), "pac": (40, 18)}
ADVANCE = (14, 18)  # the same for plain autoregression's advance (its column opened by one settle)


class _Counter(TorchDispatchMode):
    """Counts aten operations by where they run: ``session``, ``cache`` or ``network``."""

    def __init__(self) -> None:
        super().__init__()
        self.where = "session"
        self.counts = {"session": 0, "cache": 0, "network": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.where] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(WEIGHTS_DIR, device="cpu")


def tree_of(shape: str) -> DraftTree:
    settings = (AccelerationSettings(window=1) if shape == "ar" else
                AccelerationSettings.preset("pac", window=16, pd_candidates=4, pd_depth=3))
    return DraftTree.for_settings(settings, torch.device("cpu"))


def counted(session) -> tuple[_Counter, object]:
    """A counter that tells the session's, the cache's and the network's operations apart, and
    the ``mark`` to pass to the session."""
    counter = _Counter()
    write = session.store.update

    def counted_write(*args):
        counter.where = "cache"
        try:
            return write(*args)
        finally:
            counter.where = "network"

    def mark() -> None:
        counter.where = "network" if counter.where == "session" else "session"

    session.store.update = counted_write
    return counter, mark


@torch.no_grad()
def count_iteration(model: ReferenceModel, tree: DraftTree, warm_up: int = 8) -> dict[str, int]:
    """Operations of one forward + keep after ``warm_up`` iterations that keep the main path's
    first (up to) three nodes."""
    session = model.start(GenerationRequest(prompt="sneaker", guidance=2.0, max_nodes=tree.size))
    counter, mark = counted(session)
    main_path = tree.route[0]  # the nodes along candidate 0 at every depth
    keep = torch.zeros(1, tree.size, dtype=torch.bool)
    keep[0, main_path[: min(3, tree.window)]] = True
    kept = int(keep.sum())
    codes = torch.ones(1, tree.size, dtype=torch.long)
    committed = 0
    for step in range(warm_up + 1):
        slots = (committed - 1 + tree.depth)[None].clamp(max=255)
        if step == warm_up:
            with counter:
                session.forward(codes, slots, tree.ancestors, [committed], mark=mark)
                session.keep(keep)
        else:
            session.forward(codes, slots, tree.ancestors, [committed], mark=mark)
            session.keep(keep)
        committed += kept
    return counter.counts


@pytest.mark.parametrize("shape", ["ar", "pac"])
def test_forward_and_keep_do_a_pinned_number_of_operations(model, shape):
    tree = tree_of(shape)
    assert tree.size == (1 if shape == "ar" else 34)
    counts = count_iteration(model, tree)
    session, cache = PINNED[shape]
    assert counts["network"] > 100  # the counter sees the network, so it is not blind
    assert 0 < counts["session"] <= session + MARGIN, counts
    assert 0 < counts["cache"] <= cache + MARGIN, counts


@torch.no_grad()
def test_advance_does_fewer_operations_than_forward_and_keep(model):
    """Plain autoregression's step in the middle of an image, rows in step: no layout and no
    check on the device, the new column opened in the mask before the network runs."""
    session = model.start(GenerationRequest(prompt="sneaker", guidance=2.0, max_nodes=1))
    counter, mark = counted(session)
    code = torch.ones(1, dtype=torch.long)
    for committed in range(9):
        session.advance(code, [committed], mark)
    with counter:
        session.advance(code, [9], mark)
    assert counter.counts["network"] > 100
    assert 0 < counter.counts["session"] <= ADVANCE[0] + MARGIN, counter.counts
    assert 0 < counter.counts["cache"] <= ADVANCE[1] + MARGIN, counter.counts
    assert counter.counts["session"] < PINNED["ar"][0]


@pytest.mark.parametrize("backbone", session_bench.BACKBONES)
def test_cache_scaling_bench_splits_every_iteration(backbone):
    network = session_bench.random_decoder()
    outside, inside = session_bench.image_iterations(network, 4, True, session_bench.SplitClock(),
                                                     backbone)
    assert len(outside) == len(inside) == 6  # 16 slots, three kept per iteration
    assert min(outside) > 0 and min(inside) > 0


def test_the_control_attends_over_a_long_image_and_leaves_the_decoders_output_alone():
    network = session_bench.random_decoder()
    control = session_bench.decoder_parts(network, row_end=True, backbone="control").backbone
    assert control.keys.shape[2] == 64 * 65  # a 64x64 image's codes and row ends
    inputs = torch.randn(2, 5, network.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(control(inputs_embeds=inputs).last_hidden_state,
                           network.model(inputs_embeds=inputs).last_hidden_state)
    with pytest.raises(ValueError, match="backbone is 'eager'; allowed: decoder, stand-in, control"):
        session_bench.decoder_parts(network, row_end=True, backbone="eager")


def test_autoregression_bench_reports_share_and_speeds(model):
    share, speeds = session_bench.autoregression(model)
    percent = float(re.search(r"([\d.]+)% of forward \+ keep", share).group(1))
    assert 0 < percent < 100
    assert re.search(r"session: [\d.]+ ms/token; transformers generate\(\): [\d.]+ ms/token", speeds)
