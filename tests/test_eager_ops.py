"""The count of operations one iteration dispatches outside compiled code
(:mod:`sjd_core.tools.eager_ops`)."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from sjd_core.decoding import engine
from sjd_core.tools import eager_ops

# a compiled stage cannot read back what the device checks read: counted as they run in use
pytestmark = pytest.mark.usefixtures("without_device_checks")


def _event(name: str, parent=None) -> SimpleNamespace:
    return SimpleNamespace(name=name, cpu_parent=parent)


def test_only_operations_of_an_iteration_that_no_compiled_region_or_other_operation_encloses_count():
    iteration = _event(eager_ops.ITERATION)
    region = _event(eager_ops.COMPILED_REGION + ": 0/1", iteration)
    outer = _event("aten::linear", iteration)
    events = [outer, _event("aten::mm", outer), region, _event("aten::mm", region),
              _event("aten::add", _event("python call", region)), _event("aten::add", iteration),
              _event("python call", iteration),
              _event("aten::mul", _event("python call", iteration)),
              _event("aten::zeros"), _event("aten::ones", _event("python call"))]  # outside
    assert eager_ops.outside_compiled(events) == Counter({"aten::linear": 1, "aten::add": 1,
                                                          "aten::mul": 1})


def test_the_command_refuses_an_unknown_mode(capsys):
    with pytest.raises(SystemExit):
        eager_ops.main(["--modes", "ar,warp"])
    assert "--modes 'ar,warp' names warp; allowed: ar, sjd, pac+vp, auto" in capsys.readouterr().err


@pytest.mark.slow
def test_an_eager_operation_planted_in_every_step_counts_once_per_iteration(monkeypatch):
    """Compiled AR on the small model: a planted operation per step adds exactly one per
    iteration, and the network's own operations (compiled) are not counted. The first of the
    36 iterations is not counted (its span would start with the prefill)."""
    before = eager_ops.count_mode("ar")
    step = engine._Decoder.autoregressive_step
    monkeypatch.setattr(engine._Decoder, "autoregressive_step",
                        lambda decoder: torch.zeros(1).add_(1) is not None and step(decoder))
    after = eager_ops.count_mode("ar")
    assert after.iterations == before.iterations == 35
    assert after.per_iteration == pytest.approx(before.per_iteration + 2)  # zeros, add_
    assert after.by_operation["aten::zeros"] - before.by_operation["aten::zeros"] == 35
    # the codebook head's one linear per step; the network's four per step are compiled
    assert before.by_operation["aten::linear"] < 2 * before.iterations


# What an iteration still dispatches outside compiled code (8 operations, AR 9): the layout's one
# transfer to the device, the inputs' embedding, the mask's view, the copy of the iteration's
# uniforms, the logits split by guidance and the one read of the committed counts (AR reads
# none; it slices the mask to the columns in use and takes its one node's logits).
MOST_EAGER = dict.fromkeys(eager_ops.MODES, 10)


@pytest.mark.slow
def test_a_compiled_iteration_dispatches_only_a_few_operations_outside_compiled_code():
    """Every mode with its network and stages compiled: draft, verify, commit, advance, keep,
    the head and plain autoregression's draw run inside compiled regions, so an iteration
    dispatches at most ``MOST_EAGER`` operations of its own (an operation added outside
    compiled code on the hot path fails here)."""
    counts = {mode: eager_ops.count_mode(mode) for mode in eager_ops.MODES}
    assert {mode: count.iterations > 5 for mode, count in counts.items()} == dict.fromkeys(
        eager_ops.MODES, True)
    for mode, count in counts.items():
        assert count.per_iteration <= MOST_EAGER[mode], (mode, count.by_operation)
