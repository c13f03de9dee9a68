"""The decoding loop's own work per iteration is a fixed, small number of tensor operations.

Counted with a dispatch-level counter on the embedded reference model (guided, top-p active), over
a whole image: every aten operation the engine runs (planning, drafting, verification, sampling,
the trace) except those inside the session's ``forward`` and ``keep``, which
``test_session_cost.py`` pins on their own. The pinned medians per iteration leave a small margin;
a change that adds work to every iteration fails here, and so does setting-up work that grows with
the number of shapes ``auto`` considers.
"""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sjd_core.decoding.engine import generate
from sjd_core.decoding.planner import make_plan
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.reference import WEIGHTS_DIR, ReferenceModel

MARGIN = 1.05
# the all-zero check of every draw is a read and four operations: off here
pytestmark = pytest.mark.usefixtures("unchecked_draws")
# median engine operations per iteration (outside the session's forward and keep), top-p's sort
# and the float32 conversions of the logits included; the trace lays out its records once, after
# the last iteration. PAC+VP's verifier tests a tree's later candidates rank by rank, with the
# draft mass left summed directly (about 90 operations more than a packed version whose sums
# cancelled on peaky drafts)
PINNED = {"ar": 30, "pac+vp": 412}
# operations before the first forward: setting up (the plan, the state, the trace) and the first
# iteration's drafts
SET_UP = 160
# what ``auto`` adds to that per shape it considers: the shape's tables, made on the host, moved to
# the device (nine tensors, two operations each)
PER_SHAPE = 20


class _Counter(TorchDispatchMode):
    """Counts aten operations while ``counting`` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.count = 0
        self.before_first_forward: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.counting
        return func(*args, **(kwargs or {}))


class _UncountedSession:
    """A session whose ``forward`` and ``keep`` run with the counter off."""

    def __init__(self, session, counter: _Counter) -> None:
        self._session, self._counter = session, counter

    def __getattr__(self, name):
        value = getattr(self._session, name)
        if name not in ("forward", "keep", "advance"):
            return value

        def uncounted(*args, **kwargs):
            if self._counter.before_first_forward is None:
                self._counter.before_first_forward = self._counter.count
            self._counter.counting = False
            try:
                return value(*args, **kwargs)
            finally:
                self._counter.counting = True

        return uncounted


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(WEIGHTS_DIR, device="cpu")


def engine_operations(model: ReferenceModel, preset: str) -> tuple[int, np.ndarray]:
    """Operations before the first forward, and per iteration after the first, for one image."""
    counter = _Counter()
    start = model.start
    model.start = lambda request: _UncountedSession(start(request), counter)
    marks: list[int] = []
    try:
        with counter:
            generate(model, GenerationRequest(prompt="sneaker"),
                     SamplingSettings(guidance=2.0, temperature=1.0, top_k=0, top_p=0.9),
                     AccelerationSettings.preset(preset), seed=0,
                     on_iteration=lambda result: marks.append(counter.count))
    finally:
        del model.start
    return counter.before_first_forward, np.diff(marks)


@pytest.mark.parametrize("preset", list(PINNED))
def test_an_iteration_does_a_pinned_number_of_operations(model, preset):
    first, per_iteration = engine_operations(model, preset)
    assert len(per_iteration) > 20
    median = int(np.median(per_iteration))
    print(f"\n{preset}: {median} engine operations per iteration")
    assert 0 < median <= PINNED[preset] * MARGIN, median
    assert first <= SET_UP, first


def test_auto_sets_up_its_shapes_without_per_node_work(model):
    """``auto`` builds about 20 shapes before it starts; their tables are made on the host, so
    each shape costs a few operations, not some per node."""
    first, per_iteration = engine_operations(model, "auto")
    assert len(per_iteration) > 10
    plan = make_plan(AccelerationSettings.preset("auto"), model, GenerationRequest(prompt="sneaker"),
                     SamplingSettings(), torch.device("cpu"), lambda iteration: None, 256)
    shapes = len(plan.shapes)
    assert shapes >= 10, shapes
    nodes = sum(shape.size for shape in plan.shapes)
    print(f"\nauto: {first} operations before the first forward, {shapes} shapes of {nodes} nodes")
    assert first <= SET_UP + PER_SHAPE * shapes, first
