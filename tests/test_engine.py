"""The engine on the synthetic model: greedy equivalence, reproducibility, batches, settings
errors, the trace, and every mode combination (what an iteration waits for: ``test_sync.py``)."""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest
import torch

from sjd_core.decoding.engine import generate
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.synthetic import SyntheticModel
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.decoding.trace import Clock, Trace
from sjd_core.decoding.verify import ACCEPTED, BONUS, COMMIT_KINDS, FORCED, RELAXED, RESIDUAL

LOSSLESS = {
    "sjd": dict(),
    "sjd+ac": dict(adaptive_continuation=True),
    "sjd+pd": dict(proactive_drafting=True),
    "pac": dict(adaptive_continuation=True, proactive_drafting=True),
    "sjd+vp": dict(verification_prediction=True),
    "pac+vp": dict(adaptive_continuation=True, proactive_drafting=True,
                   verification_prediction=True),
}


@pytest.fixture(scope="module")
def model():
    return SyntheticModel(codebook_size=32, grid=(6, 6), width=32, layers=2, sharpness=2.0, seed=5)


def request(batch: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt="a lighthouse at dusk", negative_prompt="blurry",
                             batch_size=batch)


SAMPLING = SamplingSettings(guidance=2.5, temperature=1.0, top_k=16, top_p=0.95)
GREEDY = SamplingSettings(guidance=2.5, top_k=1)


def test_greedy_codes_are_identical_to_ar_in_every_lossless_mode(model):
    """One grid, every lossless mode, each init rule once: greedy codes equal AR's."""
    reference = generate(model, request(2), GREEDY, AccelerationSettings(window=1), seed=0).codes
    for index, (mode, options) in enumerate(LOSSLESS.items()):
        init = ("uniform", "left")[index % 2]
        settings = AccelerationSettings(window=5, init=init, **options)
        result = generate(model, request(2), GREEDY, settings, seed=123)
        assert torch.equal(result.codes, reference), (mode, init)
        assert result.trace.summary()["nfe"] < 36, (mode, init)  # the window really was used


@pytest.mark.parametrize("init", ["above", "above_target"])
def test_greedy_codes_are_ar_s_with_the_rules_that_copy_from_above(model, init):
    """A window as wide as the grid (whose new slots are drafted from the committed row above
    alone), a wider one (the general rule) and ``auto`` (whose window changes length): greedy
    codes equal AR's."""
    reference = generate(model, request(2), GREEDY, AccelerationSettings(window=1), seed=0).codes
    for settings in (AccelerationSettings.preset("pac", window=6, init=init),
                     AccelerationSettings.preset("pac", window=9, init=init),
                     AccelerationSettings.preset("auto", window=9, init=init)):
        result = generate(model, request(2), GREEDY, settings, seed=5)
        assert torch.equal(result.codes, reference), settings


def test_same_seed_and_settings_give_the_same_codes(model):
    settings = AccelerationSettings.preset("pac+vp", window=8)
    first = generate(model, request(), SAMPLING, settings, seed=42)
    second = generate(model, request(), SAMPLING, settings, seed=42)
    other = generate(model, request(), SAMPLING, settings, seed=43)
    assert torch.equal(first.codes, second.codes)
    assert not torch.equal(first.codes, other.codes)


@pytest.mark.parametrize("preset", ["ar", "pac+vp"])
def test_each_batch_row_equals_the_same_seed_generated_alone(model, preset):
    settings = AccelerationSettings.preset(preset, **({} if preset == "ar" else {"window": 8}))
    batch = generate(model, request(3), SAMPLING, settings, seed=7)
    for row in range(3):
        alone = generate(model, request(1), SAMPLING, settings, seed=7 + row)
        assert torch.equal(batch.codes[row], alone.codes[0])
    rows_nfe = batch.trace.row_nfe()
    assert batch.trace.summary()["iterations"] == rows_nfe.max()


def test_window_64_with_every_lossless_option(model):
    wide = SyntheticModel(codebook_size=64, grid=(8, 12), width=32, sharpness=2.0, seed=1)
    settings = AccelerationSettings.preset("pac+vp", window=64, vp_rises=3)
    result = generate(wide, request(2), SAMPLING, settings, seed=0)
    assert result.codes.shape == (2, 8, 12)
    assert result.trace.summary()["step_compression"] > 1.0


COMBINATIONS = list(itertools.product([False, True], [False, True], [False, True],
                                      ["none", "lantern", "gsd"], ["uniform", "left"]))


@pytest.mark.slow
@pytest.mark.parametrize("ac,pd,vp,relaxed,init", COMBINATIONS)
def test_every_combination_runs_and_commits_every_slot_once(model, ac, pd, vp, relaxed, init):
    settings = AccelerationSettings(window=6, adaptive_continuation=ac, proactive_drafting=pd,
                                    verification_prediction=vp, relaxed=relaxed, init=init,
                                    lantern_neighbours=8)
    result = generate(model, request(2), SAMPLING, settings, seed=3)
    trace = result.trace
    assert result.codes.shape == (2, 6, 6)
    assert int(result.codes.max()) < 32 and int(result.codes.min()) >= 0
    assert (trace.committed_per_iteration.sum(0) == 36).all()
    assert (trace.commit_iteration >= 0).all()
    assert (trace.commit_kind > 0).all()
    assert trace.meta["mode"] == settings.mode_name
    if relaxed == "none":
        assert not (trace.commit_kind == RELAXED).any()


def test_relaxed_slots_are_marked_in_the_trace(model):
    settings = AccelerationSettings(window=8, relaxed="lantern", lantern_neighbours=16,
                                    lantern_delta=0.5)
    trace = generate(model, request(2), SAMPLING, settings, seed=1).trace
    assert (trace.commit_kind == RELAXED).sum() > 0
    assert trace.summary()["lossless"] is False


def test_progress_reports_and_stopping(model):
    reports = []

    def stop_after_three(report):
        reports.append(report)
        if report.iteration == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(model, request(2), SAMPLING, AccelerationSettings(window=4), seed=0,
                 on_iteration=stop_after_three)
    assert [r.iteration for r in reports] == [1, 2, 3]
    assert all(r.total == 36 for r in reports)
    assert reports[-1].committed == [a + b + c for a, b, c in
                                     zip(*[r.accepted for r in reports])]
    after = generate(model, request(1), SAMPLING, AccelerationSettings(window=4), seed=0)
    assert after.codes.shape == (1, 6, 6)  # the model still works after a stopped run


def test_trace_records_and_round_trips(model):
    settings = AccelerationSettings.preset("pac", window=8)
    result = generate(model, request(2), SAMPLING, settings, seed=9)
    trace = result.trace
    summary = trace.summary()
    nfe = trace.row_nfe()
    assert summary["nfe"] == pytest.approx(nfe.mean())
    assert summary["step_compression"] == pytest.approx(np.mean(36 / nfe))
    assert sum(summary["accepted_length_histogram"]) == int((trace.committed_per_iteration > 0).sum())
    assert len(summary["accepted_length_histogram"]) == 8
    assert (trace.commit_iteration < nfe[:, None, None]).all()
    assert (trace.iterations_in_window >= 1).all()
    kinds = set(np.unique(trace.commit_kind).tolist())
    assert kinds <= {ACCEPTED, RESIDUAL, BONUS} | {5} and ACCEPTED in kinds
    accepted = trace.commit_kind == ACCEPTED
    assert np.isfinite(trace.acceptance_probability[accepted]).all()
    assert (trace.acceptance_probability[accepted] > 0).all()
    # a residual draw follows a failed test (u * q(x) > p(x), so p/q < 1); a bonus draw, none
    assert (trace.acceptance_probability[trace.commit_kind == RESIDUAL] < 1).all()
    assert np.isnan(trace.acceptance_probability[trace.commit_kind == BONUS]).all()
    assert len(trace.forward_seconds) == summary["iterations"]
    assert 0 <= summary["other_share"] < 1
    restored = Trace.from_json(trace.to_json())
    for name, array in trace.slot_maps().items():
        np.testing.assert_array_equal(restored.slot_maps()[name], array)
    assert restored.summary() == summary
    json.loads(trace.to_json())  # plain JSON, NaN written as null
    assert set(COMMIT_KINDS.values()) >= set(summary["commit_kinds"])
    tested, passed = summary["drafts_tested"], summary["draft_sources"]
    assert all(passed[rule] <= tested[rule] for rule in tested)
    kinds = summary["commit_kinds"]
    assert sum(passed.values()) == kinds["draft accepted"]
    assert sum(tested.values()) == kinds["draft accepted"] + kinds["residual draw"]
    with pytest.raises(ValueError, match="not a trace"):
        Trace.from_json('{"meta": {}}')


def test_ar_trace_has_no_tests(model):
    trace = generate(model, request(1), SAMPLING, AccelerationSettings(window=1), seed=0).trace
    assert trace.summary()["nfe"] == 36
    assert np.isin(trace.commit_kind, [BONUS, FORCED]).all()  # sampled from the target
    assert np.isnan(trace.acceptance_probability).all()
    assert (trace.iterations_in_window == 1).all()


BAD_SETTINGS = [
    (AccelerationSettings, dict(window=0), "window"),
    (AccelerationSettings, dict(window=2.5), "window"),
    (AccelerationSettings, dict(proactive_drafting=True, pd_candidates=0), "pd_candidates"),
    (AccelerationSettings, dict(proactive_drafting=True, pd_depth=0), "pd_depth"),
    (AccelerationSettings, dict(proactive_drafting=True, pd_depth=1), "pd_depth"),
    (AccelerationSettings, dict(window=4, proactive_drafting=True, pd_depth=5), "pd_depth"),
    (AccelerationSettings, dict(init="random"), "init"),
    (AccelerationSettings, dict(relaxed="fast"), "relaxed"),
    (AccelerationSettings, dict(vp_rises=0), "vp_rises"),
    (AccelerationSettings, dict(vp_top_k=0), "vp_top_k"),
    (AccelerationSettings, dict(vp_decay=1.0), "vp_decay"),
    (AccelerationSettings, dict(vp_decay=math.nan), "vp_decay"),
    (AccelerationSettings, dict(lantern_delta=-0.1), "lantern_delta"),
    (AccelerationSettings, dict(lantern_delta=math.nan), "lantern_delta"),
    (AccelerationSettings, dict(lantern_neighbours=0), "lantern_neighbours"),
    (AccelerationSettings, dict(gsd_rank_radius=-1), "gsd_rank_radius"),
    (AccelerationSettings, dict(gsd_prob_tolerance=math.inf), "gsd_prob_tolerance"),
    (AccelerationSettings, dict(window=1, adaptive_continuation=True), "adaptive_continuation"),
    (AccelerationSettings, dict(window=1, proactive_drafting=True), "proactive_drafting"),
    (AccelerationSettings, dict(window=1, verification_prediction=True),
     "verification_prediction"),
    (AccelerationSettings, dict(window=1, relaxed="lantern"), "relaxed"),
    (SamplingSettings, dict(temperature=0.0), "temperature"),
    (SamplingSettings, dict(temperature=-1.0), "temperature"),
    (SamplingSettings, dict(temperature=math.nan), "temperature"),
    (SamplingSettings, dict(top_k=-1), "top_k"),
    (SamplingSettings, dict(top_p=0.0), "top_p"),
    (SamplingSettings, dict(top_p=1.5), "top_p"),
    (SamplingSettings, dict(top_p=math.nan), "top_p"),
    (SamplingSettings, dict(guidance=-1.0), "guidance"),
    (SamplingSettings, dict(guidance=math.nan), "guidance"),
]


@pytest.mark.parametrize("kind,options,name", BAD_SETTINGS)
def test_bad_settings_name_the_setting_the_value_and_the_range(kind, options, name):
    with pytest.raises(ValueError) as error:
        kind(**options)
    message = str(error.value)
    assert message.startswith(f"{name}=")
    assert repr(options[name]) in message and "must be" in message


def test_bad_preset_and_generate_arguments(model):
    with pytest.raises(ValueError, match="preset='turbo'.*one of"):
        AccelerationSettings.preset("turbo")
    with pytest.raises(ValueError, match="override"):
        AccelerationSettings.preset("pac", windw=4)
    with pytest.raises(ValueError, match="seed=-1"):
        generate(model, request(), SAMPLING, AccelerationSettings(), seed=-1)
    with pytest.raises(ValueError, match="batch_size=0"):
        generate(model, request(0), SAMPLING, AccelerationSettings(), seed=0)


def test_presets_name_their_modes():
    assert AccelerationSettings.preset("ar").mode_name == "AR"
    assert AccelerationSettings.preset("sjd").mode_name == "SJD"
    assert AccelerationSettings.preset("pac").mode_name == "SJD+AC+PD"
    assert AccelerationSettings.preset("pac+vp", relaxed="gsd").mode_name == "SJD+AC+PD+VP+GSD"
    assert not AccelerationSettings.preset("pac+vp", relaxed="gsd").lossless


def test_vp_counts_how_often_a_rise_predicted_the_committed_code(model, monkeypatch):
    """Asked to, the trace of a VP run counts, over committed slots with a history, the slots
    whose committed code had risen N times in a row, those where some code had, and those where
    the likeliest riser was committed; checked here against the same counts made slot by slot.
    Unasked, it counts nothing and draws the same codes."""
    import sjd_core.decoding.engine as engine_module

    seen = []
    exact = engine_module._Decoder._count_rises

    def by_slot(decoder, committed, valid):
        state, n = decoder.state, decoder.acceleration.vp_rises
        for b, j in zip(*torch.nonzero(valid & state.vp_known[:, :committed.shape[1]],
                                       as_tuple=True)):
            rises = state.vp_rises[b, j] >= n
            code = int(committed[b, j])
            likeliest = int(torch.where(rises, state.vp_last[b, j], -1.0).argmax())
            seen.append((1, bool(rises[code]), bool(rises.any()),
                         bool(rises.any()) and likeliest == code))
        exact(decoder, committed, valid)

    monkeypatch.setattr(engine_module._Decoder, "_count_rises", by_slot)
    settings = AccelerationSettings.preset("pac+vp", vp_rises=1)
    request = GenerationRequest(prompt="a", batch_size=2)
    result = generate(model, request, SamplingSettings(), settings, seed=4, count_vp_rises=True)
    counts = result.trace.summary()["vp_rises"]
    assert list(counts.values()) == [int(x) for x in np.sum(seen, axis=0)], counts
    assert counts["slots"] > 50 and 0 < counts["committed_code_rose"] <= counts["some_code_rose"]
    calls = len(seen)
    unasked = generate(model, request, SamplingSettings(), settings, seed=4)
    assert len(seen) == calls and unasked.trace.summary()["vp_rises"] == {}
    assert torch.equal(unasked.codes, result.codes)
    plain = generate(model, GenerationRequest(prompt="a"), SamplingSettings(),
                     AccelerationSettings.preset("pac"), seed=4, count_vp_rises=True)
    assert plain.trace.summary()["vp_rises"] == {}


CLOCK_FAULTS = {  # what the clock does from its fourth reading on -> what the warning says
    "raises": (RuntimeError("the device's clock is gone"), "RuntimeError: the device's clock is gone"),
    "raises KeyError": (KeyError("cuda event"), "KeyError: 'cuda event'"),
    "raises ZeroDivisionError": (ZeroDivisionError("division by zero"),
                                 "ZeroDivisionError: division by zero"),
    "nan": (math.nan, "measured nan"), "zero": (0.0, "measured 0.0"),
    "infinite": (math.inf, "measured inf"), "negative": (-1.0, "measured -1.0"),
    "text": ("0.25", "measured '0.25'"), "bool": (True, "measured True"),
    "tensor": (torch.tensor(0.25), "measured tensor(0.2500)"),
}


@pytest.mark.parametrize("fault", list(CLOCK_FAULTS))
def test_auto_whose_clock_fails_feeds_a_fixed_window_and_says_so(model, monkeypatch, fault):
    """A clock that raises anything or measures no finite positive number does not stop
    ``auto``: from then on it feeds its longest window, the codes are still the model's
    (greedy: AR's), and the run's summary says when and why."""
    reference = generate(model, request(2), GREEDY, AccelerationSettings(window=1), seed=0).codes
    timed = Clock.seconds_between
    calls = []

    def failing_after_three(clock, first, last):
        calls.append(first)
        if len(calls) <= 3:
            return timed(clock, first, last)
        reading = CLOCK_FAULTS[fault][0]
        if isinstance(reading, Exception):
            raise reading
        return reading

    monkeypatch.setattr(Clock, "seconds_between", failing_after_three)
    result = generate(model, request(2), GREEDY, AccelerationSettings.preset("auto", window=8),
                      seed=7)
    assert torch.equal(result.codes, reference)
    warnings = [w for w in result.trace.summary()["warnings"] if w.startswith("auto could not")]
    assert len(warnings) == 1, result.trace.summary()["warnings"]
    expected = CLOCK_FAULTS[fault][1]
    assert expected in warnings[0] and "fixed window 8" in warnings[0]
    start = int(re.search(r"from iteration (\d+) on", warnings[0]).group(1))
    shapes = [result.trace.meta["shapes"][i] for i in result.trace.shape_per_iteration]
    assert start < len(shapes) and set(shapes[start:]) == {"window 8"}
    assert len(calls) == 4  # no further timing once it stopped


@pytest.mark.parametrize("window", [1, 2, 3])
def test_auto_fits_its_tree_into_every_window_the_widget_offers(model, window):
    """``auto`` at a short window needs no pd_depth from the user: its tree is as deep as the
    window allows (AR at window 1), and greedy codes are AR's."""
    settings = AccelerationSettings.preset("auto", window=window)
    assert settings.pd_depth <= max(window, 2) and settings.adaptive_shape == (window > 1)
    reference = generate(model, request(2), GREEDY, AccelerationSettings(window=1), seed=0).codes
    result = generate(model, request(2), GREEDY, settings, seed=0)
    assert torch.equal(result.codes, reference)


@pytest.mark.parametrize("codebook", [1, 2, 3])
def test_auto_runs_on_any_codebook_with_at_most_as_many_candidates_as_codes(codebook):
    """The ``auto`` preset tries 3 candidates per slot; on a smaller codebook it tries as many
    as there are codes (none but the draft on one code), and greedy codes are still AR's. A
    fixed mode that asks for more candidates than codes is refused (test_bad_input.py)."""
    small = SyntheticModel(codebook_size=codebook, grid=(3, 4), width=16, layers=1,
                           sharpness=2.0, seed=2)
    reference = generate(small, request(2), GREEDY, AccelerationSettings(window=1), seed=0).codes
    result = generate(small, request(2), GREEDY, AccelerationSettings.preset("auto"), seed=0)
    assert torch.equal(result.codes, reference)
    used = result.trace.meta["acceleration"]
    assert used["pd_candidates"] <= codebook
    assert used["proactive_drafting"] == (codebook > 1)
    with pytest.raises(ValueError, match=r"pd_candidates=3 .* at most the model's codebook"):
        AccelerationSettings.preset("pac", pd_candidates=3).for_codebook(2)
