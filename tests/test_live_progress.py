"""What the sampler sends the browser while it runs, without ComfyUI: chart messages at most 4 a
second and progress bar updates at most 2 a second (a fake clock stands in for time), every step
counted once, the last step always sent; and what its input check answers before a run (shown on
the node)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.pack import import_pack

pack = import_pack()
from sjd_pack.nodes import comfy_bridge, generation  # noqa: E402
from sjd_pack.nodes.handles import LoadedModel  # noqa: E402
from sjd_pack.sjd_core.decoding.engine import IterationReport  # noqa: E402
from sjd_pack.sjd_core.models.synthetic import SyntheticModel  # noqa: E402

Sampler = pack.NODE_CLASS_MAPPINGS["SJDSamplerV2"]
TOTAL = 64  # codes per image in the hand-made runs below


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, dict]]:
    """Every websocket message the nodes send, as (event, payload)."""
    messages: list[tuple[str, dict]] = []
    monkeypatch.setattr(comfy_bridge, "send",
                        lambda event, payload: messages.append((event, payload)))
    return messages


@pytest.fixture
def bar_updates(monkeypatch) -> list[tuple[int, int, object]]:
    """Every update that reaches ComfyUI's progress bar, as (value, total, preview); a stand-in
    for ``comfy.utils`` takes the place of ComfyUI's."""
    updates: list[tuple[int, int, object]] = []

    class ProgressBar:
        def __init__(self, total: int) -> None:
            self.total = total

        def update_absolute(self, value, total=None, preview=None) -> None:
            updates.append((value, total, preview))

    utils = SimpleNamespace(ProgressBar=ProgressBar)
    real = comfy_bridge._comfy
    monkeypatch.setattr(comfy_bridge, "_comfy",
                        lambda module: utils if module == "comfy.utils" else real(module))
    return updates


def reports(accepted: list[list[int]], total: int = TOTAL):
    """The engine's reports for a run whose iteration i commits ``accepted[i]`` codes per row."""
    committed = [0] * len(accepted[0])
    for i, step in enumerate(accepted, start=1):
        committed = [c + a for c, a in zip(committed, step)]
        yield IterationReport(iteration=i, committed=list(committed), accepted=list(step),
                              total=total, codes=torch.zeros(len(step), total, dtype=torch.long),
                              shape="chain 4")


def test_throttle_lets_one_update_through_per_interval_and_every_final_one():
    clock = FakeClock()
    throttle = comfy_bridge.Throttle(0.1, clock)
    seen = []
    for tick in range(25):  # 2.4 s in steps of 0.1 s / 4
        seen.append(throttle.ready())
        clock.now += 0.025
    assert seen == [True, False, False, False] * 6 + [True]
    assert throttle.ready(final=True) and throttle.ready(final=True)  # final: never held back
    assert not throttle.ready()


def test_chart_messages_are_four_a_second_and_carry_every_step_once(sent):
    clock = FakeClock()
    # 200 steps of 7 ms (1.4 s), two rows of 300 codes: the second takes 3 a step and ends after
    # 100 steps, the first takes 1 a step and its last 101 on step 200.
    accepted = [[1, 3]] * 100 + [[1, 0]] * 99 + [[101, 0]]
    watcher = generation.LiveProgress(adapter=None, grid=(8, 8), batch=2, node_id="4",
                                      mode="SJD", clock=clock)
    for report in reports(accepted, total=300):
        watcher.on_iteration(report)
        clock.now += 0.007
    watcher.flush()  # nothing left: the last step went out with the last message
    messages = [m for event, m in sent if event == generation.PROGRESS_EVENT]
    assert generation.MESSAGE_SECONDS == 0.25
    assert 6 <= len(messages) <= 7  # 1.4 s at 4 a second, plus the last step
    assert messages[0]["iteration"] == 1 and messages[0]["steps"] == [2.0]
    assert messages[-1]["iteration"] == 200 and messages[-1]["committed"] == [300, 300]
    chart = [value for m in messages for value in m["steps"]]
    assert chart == [round(v, 3) for v in watcher.accepted] and len(chart) == 200
    # each message names its last step, so the steps it carries follow on from the previous one
    ends = [m["iteration"] for m in messages]
    assert [len(m["steps"]) for m in messages] == [b - a for a, b in zip([0] + ends, ends)]
    # the mean over the rows still decoding
    assert chart[:100] == [2.0] * 100 and chart[100:199] == [1.0] * 99 and chart[-1] == 101


def test_progress_bar_updates_are_one_a_second_and_the_last_one_always_arrives(bar_updates):
    clock = FakeClock()
    bar = comfy_bridge.Progress(TOTAL, clock=clock)
    assert bar.throttle.interval == comfy_bridge.UPDATE_SECONDS == 1.0
    previews = []
    for done in range(1, TOTAL + 1):  # 64 updates 16 ms apart: 1 s
        bar.update(done, lambda: previews.append(done) or Image.new("RGB", (600, 300), done))
        clock.now += 0.016
    assert [value for value, _, _ in bar_updates] == [1, TOTAL]
    assert all(total == TOTAL for _, total, _ in bar_updates)
    assert previews == [1, TOTAL]  # a preview is made only for an update that goes out
    kind, image, size = bar_updates[-1][2]
    assert (kind, size) == ("JPEG", 512) and image.size == (600, 300)  # ComfyUI shrinks it


def test_a_sampler_run_sends_every_step_once_and_ends_full(sent, bar_updates):
    torch.manual_seed(0)
    model = LoadedModel(SyntheticModel(codebook_size=16, grid=(8, 8), sharpness=3.0), None,
                        "synthetic", torch.float32)
    out = Sampler().sample(model, prompt="p", negative_prompt="", resolution="default",
                           batch_size=2, seed=3, mode="AR", window=0, unique_id="9")
    iterations = out["ui"]["sjd_summary"][0]["iterations"]
    messages = [m for event, m in sent if event == generation.PROGRESS_EVENT]
    assert sum(len(m["steps"]) for m in messages) == iterations == 64  # AR: one code a step
    assert messages[-1]["iteration"] == iterations and messages[-1]["committed"] == [64, 64]
    assert [v for m in messages for v in m["steps"]] == out["ui"]["sjd_accepted"]
    assert bar_updates[-1][:2] == (128, 128)
    assert bar_updates[0] == (0, 128, None)  # the run starts the bar empty (no previews here)
    assert len(bar_updates) <= len(messages) + 2 < iterations


def test_a_cancelled_run_still_sends_the_steps_it_made(sent, monkeypatch):
    class Cancelled(Exception):
        pass

    calls = []

    def cancel_at_the_tenth_check() -> None:
        calls.append(1)
        if len(calls) == 10:
            raise Cancelled

    monkeypatch.setattr(comfy_bridge, "check_interrupted", cancel_at_the_tenth_check)
    torch.manual_seed(0)
    model = LoadedModel(SyntheticModel(codebook_size=16, grid=(8, 8), sharpness=3.0), None,
                        "synthetic", torch.float32)
    with pytest.raises(Cancelled):
        Sampler().sample(model, prompt="p", negative_prompt="", resolution="default",
                         batch_size=1, seed=3, mode="AR", window=0, unique_id="9")
    messages = [m for event, m in sent if event == generation.PROGRESS_EVENT]
    assert sum(len(m["steps"]) for m in messages) == 9  # the nine steps made before the cancel
    assert messages[-1]["iteration"] == 9 and messages[-1]["committed"] == [9]


def test_a_size_no_model_draws_is_refused_with_the_packs_message():
    assert generation.check_resolution("default", "SJD Sampler") is True
    assert generation.check_resolution("1024x256", "SJD Sampler") is True  # a Lumina-mGPT size
    assert generation.check_resolution(None, "SJD Sampler") is True  # linked: the run decides
    message = generation.check_resolution("1000x1000", "SJD Sampler")
    assert message.startswith("SJD Sampler: resolution='1000x1000' is not a size any SJD model")
    assert "'default'" in message


def with_previews(monkeypatch, method: str, size: int | None = None) -> None:
    """ComfyUI's command line as ``--preview-method method`` (and ``--preview-size size``; None:
    a ComfyUI without that option)."""
    args = SimpleNamespace(preview_method=SimpleNamespace(value=method))
    if size is not None:
        args.preview_size = size
    cli = SimpleNamespace(args=args)
    real = comfy_bridge._comfy
    monkeypatch.setattr(comfy_bridge, "_comfy",
                        lambda module: cli if module == "comfy.cli_args" else real(module))


@pytest.mark.parametrize("method, size, expected", [
    ("none", 512, (False, 512)), ("auto", 256, (True, 256)), ("latent2rgb", None, (True, 512))])
def test_previews_follow_comfyuis_preview_method_and_size(monkeypatch, method, size, expected):
    with_previews(monkeypatch, method, size)
    assert comfy_bridge.preview_options() == expected


def test_outside_comfyui_there_are_no_previews():
    assert comfy_bridge.preview_options() == (False, comfy_bridge.PREVIEW_SIZE)


def test_pixel_art_grows_with_sharp_pixels_and_a_large_image_is_left_to_comfyui():
    art = Image.fromarray(np.arange(32 * 32, dtype=np.uint8).reshape(32, 32) % 251).convert("RGB")
    grown = comfy_bridge.fit_preview(art, 512)
    assert grown.size == (512, 512)
    pixels = np.asarray(grown)
    assert np.array_equal(pixels, np.asarray(art).repeat(16, 0).repeat(16, 1))  # 16 x 16 blocks
    wide = comfy_bridge.fit_preview(Image.new("RGB", (64, 16)), 300)
    assert wide.size == (300, 75)
    large = Image.new("RGB", (1024, 768))
    assert comfy_bridge.fit_preview(large, 512) is large


class CountingDecoder:
    """An adapter whose decode counts its calls (a 4 x 4 grid of 8-pixel codes)."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, grid: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(grid.shape[0], 32, 32, 3)


@pytest.mark.parametrize("method", ["none", "auto"])
def test_preview_method_none_decodes_nothing_and_sends_no_image(monkeypatch, bar_updates,
                                                                 method):
    with_previews(monkeypatch, method, 128)
    adapter = CountingDecoder()
    watcher = generation.LiveProgress(adapter=adapter, grid=(4, 4), batch=1, node_id="4",
                                      mode="AR", clock=FakeClock())
    watcher.start((32, 32))
    for report in reports([[4]] * 4, total=16):
        watcher.on_iteration(report)
    images = [preview[1] for _, _, preview in bar_updates if preview is not None]
    if method == "none":
        assert adapter.calls == 0 and images == []
    else:
        # the blank image that replaces the last run's preview, then the finished image
        assert adapter.calls >= 1 and len(images) >= 2
        assert images[0].size == (128, 128) and not np.asarray(images[0]).any()
        assert all(preview[2] == 128 for _, _, preview in bar_updates if preview)


def test_a_step_that_may_compile_is_announced_at_once_and_adds_no_step(sent, monkeypatch):
    """The engine reports ``compiling`` before a step whose shape may compile (seconds on a
    CPU): the chart hears it at once, whatever the throttle, and counts no step for it."""
    monkeypatch.setattr(comfy_bridge, "check_interrupted", lambda: None)
    clock = FakeClock()
    watcher = generation.LiveProgress(None, (8, 8), 1, "9", "AUTO", clock=clock)
    watcher.previews = False
    codes = torch.zeros(1, TOTAL, dtype=torch.long)
    watcher.on_iteration(IterationReport(1, [1], [1], TOTAL, codes, "AR"))
    watcher.on_iteration(IterationReport(1, [1], [0], TOTAL, codes, "compiling", compiling=True))
    clock.now += 1.0
    watcher.on_iteration(IterationReport(2, [5], [4], TOTAL, codes, "window 4"))
    messages = [m for event, m in sent if event == generation.PROGRESS_EVENT]
    assert [(m["compiling"], m["steps"]) for m in messages] == [(False, [1.0]), (True, []),
                                                               (False, [4.0])]
    assert watcher.accepted == [1.0, 4.0]
