"""The speculative iteration's device stages, called as the engine calls them in a real
generation, each traced whole by ``torch.compile(fullgraph=True)``: a value read back, a branch
on one or a data-dependent shape would break the graph and fail here; the traced stage must give
what the engine's own call gave."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sjd_core import checks
from sjd_core.decoding import engine, stages
from sjd_core.decoding.engine import generate
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.synthetic import SyntheticModel

SAMPLING = SamplingSettings(guidance=2.0, temperature=1.0, top_k=0, top_p=0.9)
CALLED_AT = 3  # the engine's call of each stage that is kept (the drafts are warm by then)
MODES = {"sjd": AccelerationSettings.preset("sjd", window=6),
         "pac+vp": AccelerationSettings.preset("pac+vp", window=6),
         "above_target+ac": AccelerationSettings(window=6, init="above_target",
                                                 adaptive_continuation=True),
         "gsd": AccelerationSettings.preset("pac+vp", window=6, relaxed="gsd")}


def _copied(value):
    """``value`` with every tensor in it cloned (dataclasses, tuples and lists followed)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{field.name: _copied(getattr(value, field.name))
                                             for field in dataclasses.fields(value)})
    return value


def _same(got, want) -> None:
    """Equal tensors throughout (NaN where NaN)."""
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want) or torch.allclose(got, want, equal_nan=True, rtol=0, atol=0)
    elif dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            _same(getattr(got, field.name), getattr(want, field.name))
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _same(a, b)
    elif isinstance(want, np.ndarray):
        assert np.array_equal(got, want)
    else:
        assert got == want


@pytest.fixture(scope="module")
def model() -> SyntheticModel:
    return SyntheticModel(codebook_size=32, grid=(6, 6), width=32, layers=1, heads=2,
                          sharpness=2.0, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["draft", "verify", "commit", "advance", "conclude"])
def test_each_stage_traces_as_one_graph_and_gives_the_engines_result(model, mode, name,
                                                                     monkeypatch):
    monkeypatch.setattr(checks, "DEVICE_CHECKS", False)  # its check reads the weights back
    stage, kept = getattr(stages, name), {}

    def keeping(*args, **kwargs):
        kept["calls"] = kept.get("calls", 0) + 1
        if kept["calls"] == CALLED_AT:
            kept["inputs"] = _copied((args, kwargs))
        result = stage(*args, **kwargs)
        if kept["calls"] == CALLED_AT:
            kept["outputs"] = _copied((result, args, kwargs))  # args: what it changed in place
        return result

    monkeypatch.setattr(stages, name, keeping)  # as conclude calls verify, commit and advance
    monkeypatch.setattr(engine, name, keeping, raising=False)  # as the engine calls the others
    generate(model, GenerationRequest(prompt="a red fox", batch_size=2), SAMPLING, MODES[mode],
             seed=3)
    assert kept["calls"] > CALLED_AT
    args, kwargs = kept["inputs"]
    torch.compiler.reset()  # graphs other tests compiled of this stage count to torch's limit
    traced = torch.compile(stage, fullgraph=True, backend="eager", dynamic=False)
    with torch.inference_mode():
        result = traced(*args, **kwargs)
    _same((result, args, kwargs), kept["outputs"])


def test_an_autoregressive_step_keeps_each_rows_target_as_its_columns_latest():
    """``above_target`` drafts start from the target of the slot above: a plain autoregressive
    step writes each row's target into the column of the slot it draws (rows at different
    columns included), and nothing into any other column."""
    width, vocab = 4, 6
    logits = torch.randn(2, vocab)
    committed = torch.tensor([1, 6])  # the slots drawn now: columns 1 and 2
    codes = torch.zeros(2 * 17, dtype=torch.long)
    column_targets = torch.full((2, width + 1, vocab), -1.0)
    drawn = stages.autoregressive(logits, None, SamplingSettings(), 1.0, torch.rand(2, 1),
                                  committed, torch.tensor([0, 17]), codes, column_targets, width)
    target = torch.softmax(logits, -1)
    assert torch.allclose(column_targets[0, 1], target[0]) and torch.allclose(column_targets[1, 2], target[1])
    untouched = torch.ones(2, width + 1, dtype=torch.bool)
    untouched[0, 1] = untouched[1, 2] = False
    assert bool((column_targets[untouched] == -1.0).all())
    assert torch.equal(drawn.committed, committed + 1)
    assert torch.equal(codes[drawn.written], drawn.token)
