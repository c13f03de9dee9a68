"""How often decoding makes the host wait for the device, per iteration of whole generations.

What costs on a GPU is not the number of tensor operations but the host stopping until the device
catches up: values read back (``.item()``, ``.tolist()``, ``bool(t)``, boolean-mask indexing,
``.cpu()``...) and host data copied to the device in a way the host waits for
(``torch.tensor(data, device=...)``, ``.to(device)`` of a host tensor...). The one path for host
data is :func:`sjd_core.transfer.host_to_device` (one pinned, non-blocking copy on CUDA).

Both are counted by :class:`sjd_core.tools.host_reads.HostReads` with ``cpu_is_device``: on the
CPU (CI has no GPU) the CPU stands for the device, and host tensors are told apart by where the
decoding code made them, so a copy that would block on CUDA is seen here too.

Counted on the embedded reference model (its transformers session, guided, top-p active), over
every iteration of a whole image, so at every cached length (what an iteration waits for does
not grow with the cache): plain autoregression's steps wait for nothing; a speculative step reads
at most one value back (the slots each row committed) and copies nothing in a blocking way. Each
mode runs with one image and with four, whose images finish at different iterations and leave
the batch (``retain``); ``auto`` runs both kinds of step. Setting up, before the first iteration,
is counted apart.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sjd_core.decoding import engine, planner
from sjd_core.decoding.engine import generate
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.reference import WEIGHTS_DIR, ReferenceModel
from sjd_core.tools.host_reads import HostReads
from sjd_core.transfer import host_to_device, pack, to_device

# the all-zero check of every draw is a read: off here
pytestmark = pytest.mark.usefixtures("without_device_checks")

# the most (values read back, blocking copies from the host) per iteration, by kind of step
MOST_PER_ITERATION = {"AR": (0, 0), "speculative": (1, 0)}
SAMPLING = SamplingSettings(guidance=2.0, temperature=1.0, top_k=0, top_p=0.9)


@pytest.fixture(scope="module")
def model():
    """The reference model, run on one thread (the machine's cores are shared: fast enough)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ReferenceModel(WEIGHTS_DIR, device="cpu")
    torch.set_num_threads(threads)


class _Stop(Exception):
    pass


@dataclass
class Waits:
    """What one generation waited for: per iteration (from the plan's choice to the report)
    the reads and blocking copies, the shape it fed and the slots committed per image; and the
    same two counts before the first iteration (``set_up``)."""

    reads: np.ndarray
    copies: np.ndarray
    shapes: list[str]
    committed: list[list[int]]
    set_up: tuple[int, int]

    def most(self, step: str) -> tuple[int, int]:
        """The most reads and blocking copies of one iteration of ``step`` ("AR" or
        "speculative"); (-1, -1) when no iteration took that step."""
        taken = np.array([(shape == "AR") == (step == "AR") for shape in self.shapes])
        if not taken.any():
            return -1, -1
        return int(self.reads[taken].max()), int(self.copies[taken].max())


def count_waits(model: ReferenceModel, settings: AccelerationSettings, batch: int,
                monkeypatch: pytest.MonkeyPatch, iterations: int | None = None) -> Waits:
    """Run one generation (its first ``iterations`` only, when given) under the counter; an
    iteration starts when the plan chooses its shape and ends when it is reported (after
    finished rows left the batch). ``auto`` starts from nothing learnt."""
    waits = HostReads(cpu_is_device=True)
    starts: list[tuple[int, int]] = []
    ends: list[tuple[int, int]] = []
    shapes: list[str] = []
    committed: list[list[int]] = []
    make_plan = engine.make_plan

    def plan_that_marks(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        choose = plan.choose

        def marked_choose():
            starts.append((waits.count, waits.blocking_copies))
            return choose()

        plan.choose = marked_choose
        return plan

    def reported(report) -> None:
        ends.append((waits.count, waits.blocking_copies))
        shapes.append(report.shape)
        committed.append(report.committed)
        if len(ends) == iterations:
            raise _Stop

    monkeypatch.setattr(engine, "make_plan", plan_that_marks)
    monkeypatch.setattr(planner, "_PROFILES", weakref.WeakKeyDictionary())
    with waits, pytest.raises(_Stop) if iterations else contextlib.nullcontext():
        generate(model, GenerationRequest(prompt="sneaker", batch_size=batch), SAMPLING, settings,
                 seed=0, on_iteration=reported)
    per_iteration = np.array(ends) - np.array(starts)
    return Waits(per_iteration[:, 0], per_iteration[:, 1], shapes, committed, starts[0])


def rows_left_early(waits: Waits, slots: int) -> bool:
    """Whether some image finished (all ``slots`` committed) while another was still decoding."""
    return any(min(row) < max(row) == slots for row in waits.committed)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", ["ar", "sjd", "pac+vp", "auto"])
def test_an_iteration_waits_for_the_device_at_most_once(model, mode, batch, monkeypatch):
    waits = count_waits(model, AccelerationSettings.preset(mode), batch, monkeypatch)
    measured = {step: waits.most(step) for step in MOST_PER_ITERATION}
    print(f"\n{mode} x {batch}: {len(waits.shapes)} iterations, most (reads, blocking copies) "
          f"per iteration {measured}, set-up {waits.set_up}")
    slots = model.grid[0] * model.grid[1]
    assert waits.committed[-1] == [slots] * batch
    if mode == "ar":
        assert set(waits.shapes) == {"AR"}
    elif mode == "auto":  # it switches from plain AR steps to a speculative window and back
        kinds = ["AR" if shape == "AR" else "speculative" for shape in waits.shapes]
        assert "AR" in kinds and "speculative" in kinds[kinds.index("AR"):], waits.shapes
    else:
        assert "AR" not in waits.shapes
    if batch > 1 and mode != "ar":  # images finish at different iterations and leave the batch
        assert rows_left_early(waits, slots), waits.committed
    for step, most in MOST_PER_ITERATION.items():
        if measured[step] != (-1, -1):
            assert measured[step][0] <= most[0] and measured[step][1] <= most[1], (step, measured)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sjd", "pac+vp"])
def test_relaxed_acceptance_waits_as_the_lossless_modes(model, mode, monkeypatch):
    """GSD's relaxed test reads nothing more back than the exact one."""
    waits = count_waits(model, AccelerationSettings.preset(mode, relaxed="gsd"), 2, monkeypatch)
    assert "AR" not in waits.shapes
    most_reads, most_copies = MOST_PER_ITERATION["speculative"]
    assert waits.reads.max() <= most_reads and waits.copies.max() <= most_copies


def test_auto_sets_up_its_shapes_without_waiting_per_shape(model, monkeypatch):
    """``auto`` builds many shapes before it starts; setting them up should wait on the device
    no more often than setting up a fixed mode's one shape."""
    fixed = count_waits(model, AccelerationSettings.preset("pac+vp"), 1, monkeypatch, iterations=1)
    auto = count_waits(model, AccelerationSettings.preset("auto"), 1, monkeypatch, iterations=1)
    print(f"\nset-up (reads, blocking copies): pac+vp {fixed.set_up}, auto {auto.set_up}")
    assert auto.set_up[1] <= fixed.set_up[1], (auto.set_up, fixed.set_up)


def test_the_counter_sees_waits_the_cpu_would_hide():
    """On the CPU the counter is not blind: planted reads and blocking copies are counted, the
    one path for host data (``host_to_device``) and work on host tensors are not."""
    device = torch.device("cpu")
    waits = HostReads(cpu_is_device=True)
    made_before = torch.arange(4)  # tensors made before counting are the device's
    with waits:
        x = torch.arange(4, device=device)
        x.tolist()
        bool(x[0] > 0)
        x[x > 1]
        int(made_before.sum())
        x.cpu()
        reads = waits.count
        torch.tensor([1, 2], device=device)
        torch.arange(3).to(device)
        x.copy_(torch.from_numpy(np.arange(4)))
        x + torch.ones(4)  # a host tensor used with device tensors: copied over (or an error)
        copies = waits.blocking_copies
        sent = host_to_device({"rows": np.arange(4), "mask": np.ones(2, dtype=bool)}, device)
        sent["rows"] + x  # host_to_device's tensors are the device's
        pack({"rows": np.arange(4)}, device).part("rows") + x  # and pack's
        to_device(x, device)
        host = torch.tensor([3, 1, 2])  # host tensors: reading them waits for nothing
        host.tolist()
        host[host > 1]
        x + host[0]  # a single number goes with the kernel
    assert (reads, copies) == (5, 4)
    assert (waits.count, waits.blocking_copies) == (reads, copies)


def test_the_counter_sees_reads_of_any_tensor_by_default():
    """Without ``cpu_is_device`` (as ``gpu_check`` counts) every read counts, CPU tensors' too,
    but numpy's view of CPU memory and a move to a CPU run's own device do not."""
    reads = HostReads()
    x = torch.arange(4)
    with reads:
        x.tolist()
        bool(x[0] > 0)
        x[x > 1]
        int(x.sum())
        x.cpu()
        x.numpy()  # a CPU tensor's memory is the host's: not a read
        x.to(torch.device("cpu"), torch.float32)  # a CPU run's own device (see to_device)
        with pytest.raises(TypeError):  # another device's is one (numpy refuses it)
            torch.empty(2, device="meta").numpy()
    assert reads.count == 6


def test_packed_arrays_come_back_as_they_were_from_one_tensor():
    """``pack`` sends host arrays as one int64 tensor; each array comes back with its shape,
    booleans as booleans, and an array not packed as None."""
    arrays = {"positions": np.arange(6).reshape(2, 3), "real": np.array([[True], [False]]),
              "slots": np.array([[-1, 7]])}
    packed = pack(arrays, torch.device("cpu"))
    assert packed.flat.shape == (10,) and packed.flat.dtype == torch.int64
    for name, array in arrays.items():
        part = packed.part(name)
        assert part.dtype == (torch.bool if array.dtype == bool else torch.int64), name
        assert np.array_equal(part.numpy(), array), name
    assert packed.part("visible") is None
