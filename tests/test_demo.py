"""The command-line tools (demo, benchmarks) and the heatmap pictures they draw."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sjd_core.decoding.settings import DEFAULT_PRESET, AccelerationSettings
from sjd_core.models import movqgan
from sjd_core.tools import bench, demo
from sjd_core.tools.cli import ImageProgress, default_threads
from sjd_core.tools.reference import benchmark
from sjd_core.figures import (GREY, UNITS, acceptance_figure, colour_bar, colourise,
                                   committed_together, heatmap, histogram_figure, image_grid,
                                   labelled_panel, rule_legend, rule_map)
from sjd_core.decoding.drafting import ABOVE_TARGET_INIT, AC_KEPT, LEFT_INIT, UNIFORM_INIT


ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("sjd_core.tools.demo", "sjd_core.tools.bench", "sjd_core.tools.reference.benchmark")


@pytest.fixture(autouse=True)
def keep_thread_count():
    """The tools set torch's thread count for the whole process: restore it for later tests."""
    import torch

    count = torch.get_num_threads()
    yield
    torch.set_num_threads(count)


def test_demo_writes_image_and_heatmap_and_reports_the_speedup(tmp_path, capsys):
    """A fixed speculative mode (what AUTO feeds follows the machine's clock; its summary is
    tested below), so the forward-pass count does not depend on timing."""
    report = demo.main(["--prompt", "sneaker", "--out", str(tmp_path), "--window", "8",
                        "--mode", "pac", "--device", "cpu", "--threads", "1"])
    image, figure = Image.open(report["image"]), Image.open(report["heatmap"])
    assert report["image"] == str(tmp_path / "sneaker.png")
    assert report["heatmap"] == str(tmp_path / "sneaker_heatmap.png")
    assert image.size == (260, 260)  # 32 px scaled 8x, 2 px border
    panel = labelled_panel(np.zeros((256, 256, 3)), "t", (0, 1), "u")
    # the image, three maps and the draft rules (their legend may be taller than a colour bar)
    assert figure.size[0] == 8 + 5 * (256 + 8) and figure.size[1] >= panel.height + 16
    assert report["ar_nfe"] == 256 and report["nfe"] < 256
    printed = capsys.readouterr()
    assert f"speed-up over AR: {report['speedup']:.2f}x wall-clock" in printed.out
    assert "torch CPU threads: 1" in printed.out
    # one progress bar per run (the default mode, then AR), each reaching all 256 codes with a
    # rate and ETA
    assert report["mode"] == AccelerationSettings.preset("pac", window=8).mode_name
    bars = printed.err.replace("\r", "\n")
    for mode in (f"{report['mode']} 'sneaker'", "AR 'sneaker'"):
        assert f"{mode}: 100%" in bars and "256/256 [" in bars and "code/s]" in bars


def test_demo_runs_auto_by_default_and_says_what_it_fed(tmp_path, capsys):
    report = demo.main(["--prompt", "bag", "--out", str(tmp_path), "--no-baseline",
                        "--threads", "1"])
    assert report["mode"] == AccelerationSettings.preset(DEFAULT_PRESET).mode_name
    assert 0 < report["nfe"] <= 256
    summary = capsys.readouterr().out
    assert "  fed AR: no window paid" in summary or "  fed window " in summary
    assert "learning took " in summary


def test_demo_mode_ar_runs_ar_once(tmp_path, capsys, monkeypatch):
    runs = []
    original = demo.timed
    monkeypatch.setattr(demo, "timed", lambda *a: runs.append(a[3].mode_name) or original(*a))
    report = demo.main(["--prompt", "bag", "--mode", "ar", "--out", str(tmp_path), "--threads",
                        "1"])
    assert runs == ["AR"] and report["nfe"] == 256 and "speedup" not in report
    assert "speed-up" not in capsys.readouterr().out


@pytest.mark.slow
def test_demo_compiled_is_held_to_the_faster_of_compiled_and_uncompiled_ar(tmp_path, capsys,
                                                                            monkeypatch):
    """With --compile both modes run compiled, and AR also runs uncompiled: the speed-up is
    against the fastest AR (compiling is replaced by a pass-through here, to keep it fast)."""
    import torch

    runs = []
    original = demo.timed
    monkeypatch.setattr(torch, "compile", lambda network, **options: network)
    monkeypatch.setattr(demo, "timed", lambda *a: runs.append(
        (a[3].mode_name, a[3].compile)) or original(*a))
    report = demo.main(["--prompt", "bag", "--compile", "--out", str(tmp_path), "--threads",
                        "1", "--device", "cpu"])
    assert runs == [(report["mode"], True), ("AR", True), ("AR", False)]
    printed = capsys.readouterr().out
    assert f"AR uncompiled: {report['ar_eager_seconds']:.2f} s" in printed
    fastest = min(report["ar_seconds"], report["ar_eager_seconds"])
    assert report["speedup"] <= fastest / report["seconds"] + 1e-9


@pytest.mark.slow
def test_bench_compile_stages_adds_a_row_per_mode(monkeypatch, capsys):
    """Compiling is replaced by a pass-through here, to keep it fast."""
    import torch

    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    monkeypatch.setattr(bench, "transformers_generate", lambda *a: 1.0)
    records = bench.main(["--images", "1", "--modes", "AR,SJD", "--threads", "1", "--compile",
                          "--compile-stages"])
    assert [r["mode"] for r in records] == ["transformers generate()", "AR", "SJD",
                                            "AR + stages", "SJD + stages", "AR eager"]
    assert "SJD + stages first compiled image: " in capsys.readouterr().out


@pytest.mark.slow
def test_bench_windows_adds_fixed_windows_that_auto_is_held_to(monkeypatch, capsys):
    monkeypatch.setattr(bench, "transformers_generate", lambda *a: 1.0)
    records = bench.main(["--images", "1", "--modes", "AR,auto", "--threads", "1",
                          "--windows", "4,8"])
    assert [r["mode"] for r in records] == ["transformers generate()", "AR", "auto",
                                            "AC+above, window 4", "AC+above, window 8"]
    assert [r["step_compression"] > 1.0 for r in records[3:]] == [True, True]
    fastest = max(records[3:], key=lambda r: r["speedup_vs_ar"])["mode"]
    assert f"auto / fastest fixed lossless mode ({fastest}): " in capsys.readouterr().out


@pytest.mark.slow
def test_demo_picks_its_thread_count_and_says_so(tmp_path, capsys):
    demo.main(["--prompt", "bag", "--mode", "ar", "--out", str(tmp_path)])
    assert 1 <= default_threads() <= 4
    assert f"torch CPU threads: {default_threads()} (--threads to change)" in capsys.readouterr().out


@pytest.mark.parametrize("tool, argv, expected", [
    (demo, ["--prompt", "spaceship", "--no-baseline"], "prompt='spaceship' names no known class"),
    (demo, ["--window", "-1", "--no-baseline"], "window=-1 is not allowed"),
    (demo, ["--batch", "0"], "--batch=0 is not allowed"),
    (demo, ["--mode", "fastest"], "argument --mode: invalid choice: 'fastest'"),
    (bench, ["--modes", "AR,turbo"], "--modes='AR,turbo' is not allowed: ['turbo']"),
    (bench, ["--images", "0"], "--images=0 is not allowed"),
    (bench, ["--compile-stages"], "--compile-stages is not allowed without --compile"),
    (bench, ["--windows", "1,8"], "argument --windows: '1,8' is not allowed: it must be window "
                                  "lengths (integers >= 2)"),
    (bench, ["--windows", "four"], "argument --windows: 'four' is not allowed"),
    (benchmark, ["--per-class", "1"], "--per-class=1 is not allowed"),
    (benchmark, ["--model", "/nowhere/at/all"], "/nowhere/at/all"),
    (demo, ["--threads", "-1"], "--threads=-1 is not allowed: it must be >= 0"),
    (demo, ["--prompt", "!!!"], "prompt='!!!' names no known class"),
    (demo, ["--prompt", "bag", "\U0001f98a"], "prompt='\U0001f98a' names no known class"),
    (bench, ["--threads", "-1"], "argument --threads: '-1' is not allowed: it must be an integer >= 0"),
    (demo, ["--out", __file__], "argument --out: '" + __file__ + "' is a file, not a folder"),
    (bench, ["--json", "{tmp}"], "argument --json: '{tmp}' is a folder; name a file to write"),
    (bench, ["--json", "{tmp}/no/such/folder.json"], "the folder '{tmp}/no/such' does not exist"),
    (demo, ["--device", "cuda:99"], "argument --device: 'cuda:99' is not available"),
    (bench, ["--device", "cuda:99"], "argument --device: 'cuda:99' is not available"),
    (demo, ["--device", "tpu"], "argument --device: 'tpu' is not a torch device"),
    (demo, ["--model", "/dev/zero", "--no-baseline"], "Model path '/dev/zero' is a character device"),
    (bench, ["--model", "{tmp}/damaged.ckpt"], "'{tmp}/damaged.ckpt' is not a checkpoint of a known"),
    (movqgan, ["{tmp}/damaged.ckpt", "{tmp}/out.safetensors"],
     "Could not read '{tmp}/damaged.ckpt' as a weights-only checkpoint"),
    (movqgan, ["{tmp}/refused.ckpt", "{tmp}/out.safetensors"], "weights-only"),
    (movqgan, ["{tmp}/missing.ckpt", "{tmp}/out.safetensors"],
     "MoVQGAN weights file '{tmp}/missing.ckpt' does not exist"),
    (movqgan, ["{tmp}/damaged.ckpt", "{tmp}"], "argument out: '{tmp}' is a folder"),
])
def test_mistakes_print_one_line_and_exit_2(tool, argv, expected, tmp_path, capsys):
    """Every mistake a user can make on a command line (a bad argument, a device this machine
    lacks, an output path that is taken, a missing, damaged or refused file) is one line on
    stderr and exit code 2, before any long work."""
    import torch

    (tmp_path / "damaged.ckpt").write_bytes(bytes(range(256)) * 16)
    torch.save({"state_dict": {"w": torch.zeros(1)}, "code": ImageProgress}, tmp_path / "refused.ckpt")
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    expected = expected.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as stop:
        tool.main(argv + (["--out", str(tmp_path)] if tool is demo and "--out" not in argv else []))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert err[0].startswith(f"python -m {tool.__name__}: error: ")
    assert err[0].endswith("(run with --help for the options)") and "Traceback" not in err[0]


def test_bench_refuses_a_batch_that_cannot_fit_before_any_generation(monkeypatch, capsys):
    """``--batch 100000`` is refused by the batch check before transformers' generate() or any
    mode runs."""
    def never(*args, **kwargs):
        raise AssertionError("a generation ran before the batch was refused")

    monkeypatch.setattr(bench, "transformers_generate", never)
    monkeypatch.setattr(bench, "timed", never)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--batch", "100000", "--images", "1", "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1
    assert "batch_size=100000 is not allowed" in err[0] and "GiB are free" in err[0]


@pytest.mark.parametrize("module", TOOLS)
def test_help_answers_without_importing_torch(module):
    code = (f"import sys, {module} as m\n"
            "try:\n    m.main(['--help'])\nexcept SystemExit as stop:\n    assert stop.code == 0\n"
            "print('torch' in sys.modules)")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    seconds = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("False"), "torch was imported to print --help"
    assert "usage: python -m " in out.stdout
    assert seconds < 2.0, f"{module} --help took {seconds:.1f} s"


def test_the_progress_bar_draws_at_most_every_refresh_and_always_the_end(capsys, monkeypatch):
    from sjd_core.decoding.engine import IterationReport

    clock = iter([0.0, 0.05, 0.1, 0.25, 0.3, 0.31])  # one report per iteration, these times
    monkeypatch.setattr("sjd_core.tools.cli.time.monotonic", lambda: next(clock))
    bar, drawn = ImageProgress("test"), []
    for committed in (10, 20, 30, 40, 50, 64):
        bar(IterationReport(0, [committed], [10], 64, None, "chain 16"))
        drawn.append(None if bar.bar is None else bar.bar.n)
    # the first report opens the bar, the next ones within 0.2 s are skipped, 0.25 s draws and
    # the last report (all codes) draws and closes it
    assert drawn == [10, 10, 10, 40, 40, None]
    assert "test: 100%" in capsys.readouterr().err.replace("\r", "\n")


@pytest.mark.slow
def test_benchmarks_show_a_progress_bar_per_image(capsys, tmp_path):
    records = bench.main(["--images", "2", "--modes", "AR", "--threads", "1",
                          "--json", str(tmp_path / "bench.json")])
    captured = capsys.readouterr()
    bars = captured.err.replace("\r", "\n")
    assert "AR 't-shirt' seed 0: 100%" in bars and "AR 'trouser' seed 1: 100%" in bars
    assert "256/256 [" in bars and "code/s]" in bars
    assert "image 2/2" in captured.out  # the progress line
    assert [r["mode"] for r in records] == ["transformers generate()", "AR"]
    assert all(r["speedup_vs_ar"] > 0 for r in records)
    written = json.loads((tmp_path / "bench.json").read_text())  # strict JSON: no NaN
    assert written == records
    assert set(written[1]) == {"mode", "nfe_per_image", "seconds_per_image", "speedup_vs_ar",
                               "step_compression", "outside_forward_share"}
    assert written[0]["outside_forward_share"] is None and 0 < written[1]["outside_forward_share"] < 1


def test_the_bench_holds_auto_to_the_fastest_fixed_lossless_mode():
    """Lossy and other cost-aware rows are not what auto is compared with."""
    records = [{"mode": mode, "speedup_vs_ar": speed} for mode, speed in
               [("AR", 1.0), ("SJD", 1.7), ("AC+above", 2.5), ("lossy", 3.0), ("auto", 2.4),
                ("auto per pass", 2.0)]]
    modes = {"AR": bench.MODES["AR"], "SJD": bench.MODES["SJD"],
             "AC+above": bench.MODES["AC+above"], "auto": bench.MODES["auto"],
             "lossy": AccelerationSettings(relaxed="gsd"),
             "auto per pass": AccelerationSettings.preset("auto", shape_cost="passes")}
    assert bench.against_fixed(records, modes) == (
        "auto / fastest fixed lossless mode (AC+above): 0.960; "
        "auto per pass / fastest fixed lossless mode (AC+above): 0.800")
    assert bench.against_fixed(records[:2], {"AR": modes["AR"], "SJD": modes["SJD"]}) == (
        "auto / fastest fixed lossless mode: not measured (the run lacks one of the two)")


def test_colour_ramp_and_heatmap_layout():
    values = np.array([[[0.0, 1.0], [0.5, np.nan]]])
    rgb = colourise(values)
    assert rgb.shape == (1, 2, 2, 3) and rgb.min() >= 0 and rgb.max() <= 1
    assert not np.allclose(rgb[0, 0, 0], rgb[0, 0, 1])  # low and high differ
    assert np.allclose(rgb[0, 1, 1], 0.5)  # NaN is grey
    tiles = heatmap(values, cell=4)
    assert tiles.shape == (1, 8, 8, 3) and np.array_equal(tiles[0, :4, :4], np.broadcast_to(rgb[0, 0, 0], (4, 4, 3)))
    with pytest.raises(ValueError, match="cell=0 is not allowed"):
        heatmap(values, cell=0)


def test_acceptance_figure_and_grid():
    maps = {"commit_iteration": np.arange(32).reshape(2, 4, 4),
            "acceptance_probability": np.full((2, 4, 4), 0.5)}
    figure = acceptance_figure(maps, image=np.zeros((8, 8, 3)), row=1, cell=40)
    panel = labelled_panel(np.zeros((160, 160, 3)), "t", (0, 1), "u")
    assert figure.size == (8 + 4 * (160 + 8), panel.height + 16)
    sources = np.array([[[UNIFORM_INIT, LEFT_INIT], [ABOVE_TARGET_INIT, AC_KEPT]]] * 2)
    with_rules = acceptance_figure({**maps, "draft_source": sources.repeat(2, 1).repeat(2, 2)},
                                   row=1, cell=40)
    assert with_rules.size[0] == 8 + 4 * (160 + 8)  # three maps and the draft rules
    legend = rule_legend(160, sources)
    assert legend.height > 4 * 16  # one line per rule that occurs (four)
    rgb = rule_map(sources, cell=1)
    assert len({tuple(c) for c in rgb[0].reshape(-1, 3)}) == 4  # a colour per rule
    with pytest.raises(ValueError, match="row=2 is not allowed"):
        acceptance_figure(maps, row=2)
    with pytest.raises(ValueError, match="lacks"):
        acceptance_figure({"commit_iteration": maps["commit_iteration"]})
    together = committed_together(np.array([[[0, 0, 1], [2, 2, 2]], [[5, 6, 6], [6, 7, 7]]]))
    assert together.tolist() == [[[2, 2, 1], [3, 3, 3]], [[1, 3, 3], [3, 2, 2]]]
    grid = image_grid(np.ones((5, 4, 4, 3)), columns=2, scale=3, gap=1)
    assert grid.size == (2 * 12 + 3, 3 * 12 + 4)


def test_every_map_panel_has_a_colour_bar_with_unit_and_a_grey_legend():
    tile = np.ones((200, 200, 3))
    panel = np.asarray(labelled_panel(tile, "commit iteration", (0, 9), UNITS["commit_iteration"]))
    bar = np.asarray(colour_bar(200, (0, 9), UNITS["commit_iteration"]))
    strip = panel[-bar.shape[0]:]
    assert np.array_equal(strip, bar)
    ramp = colourise(np.array([0.0, 1.0])) * 255
    row = strip[5, 2:198].astype(float)
    assert np.abs(row[0] - ramp[0]).max() < 3 and np.abs(row[-1] - ramp[1]).max() < 3
    assert (np.abs(strip.astype(int) - GREY).max(axis=-1) == 0).sum() > 20  # the grey swatch
    blank = np.asarray(labelled_panel(tile, "commit iteration", (0, 9), None))
    assert (blank[-bar.shape[0]:] == 255).all()  # no bar where no map is shown
    assert not np.array_equal(np.asarray(colour_bar(200, (0, 9), "a")),
                              np.asarray(colour_bar(200, (0, 9), "b")))  # the unit is written


def test_histogram_has_bars_and_labelled_axes():
    empty = np.asarray(histogram_figure([0, 0, 0], "AR"))
    full = np.asarray(histogram_figure([5, 0, 1], "AR"))
    teal = (np.abs(full.astype(int) - (33, 145, 140)).max(axis=-1) == 0)
    assert teal.sum() > 500 and not (np.abs(empty.astype(int) - (33, 145, 140)).max(axis=-1) == 0).any()
    dark = (full.min(axis=-1) < 100)
    assert dark[:, :20].any() and dark[-22:].any()  # text of the y and x axis labels


def test_reference_benchmark_lists_the_shapes_auto_fed():
    rows = [{"mode": "AR", "shapes": {"AR": 256}},
            {"mode": "auto", "shapes": {"window 32": 30, "window 16": 200, "AR": 1}}]
    assert benchmark.shapes_fed(rows) == "  auto: window 16 x200, window 32 x30, AR x1"


def test_shape_counts_are_written_most_first_and_the_rest_counted():
    from sjd_core.decoding.trace import shape_counts_text

    shapes = {"AR": 1, "window 16": 200, "window 32": 30, "window 8": 9, "window 4": 2, "x": 1}
    assert shape_counts_text(shapes, shown=4) == (
        "window 16 x200, window 32 x30, window 8 x9, window 4 x2, 2 more")
    assert shape_counts_text({"AR": 1, "window 16": 5}) == "window 16 x5, AR x1"


def test_reference_benchmark_lists_how_often_each_draft_rule_passed():
    rows = [{"mode": "AR", "drafts": {"drawn by VP": (0, 0)}},
            {"mode": "PAC+VP", "drafts": {"drawn by VP": (40, 10), "drawn from target": (20, 15),
                                          "PD sibling": (5, 5)}}]
    assert benchmark.draft_rules(rows) == (
        "  PAC+VP: drawn by VP 10/40 (25%); drawn from target 15/20 (75%)")


def test_reference_benchmark_prints_how_well_vp_rises_predicted_the_committed_code():
    counts = dict(slots=200, committed_code_rose=18, some_code_rose=60, likeliest_riser_committed=9)
    rows = [{"mode": "AR", "vp_rises": dict.fromkeys(counts, 0)},
            {"mode": "PAC+VP", "vp_rises": counts}]
    assert benchmark.vp_rises(rows) == (
        "  PAC+VP: of 200 slots, the committed code had risen in 9.0%; some code had risen in "
        "30.0%, and there the likeliest riser was the committed code in 15.0%")


def test_reference_benchmark_runs_the_rows_it_is_told_to_after_ar(capsys):
    args = benchmark.parse_args(["--modes", "auto; AC+above+VP, N=1"])
    assert [label for label, _ in args.modes] == ["AR", "auto", "AC+above+VP, N=1"]
    assert benchmark.parse_args([]).modes is None  # every row of the table
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--modes", "auto;turbo"])
    assert "--modes='auto;turbo' is not allowed" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("mode, window", [("auto", 32), ("pac", 16)])
def test_demo_window_0_is_the_modes_own(tmp_path, capsys, mode, window):
    demo.main(["--prompt", "bag", "--mode", mode, "--no-baseline", "--out", str(tmp_path),
               "--threads", "1"])
    assert f"(window {window}, " in capsys.readouterr().out


def test_the_bench_holds_auto_to_the_faster_ar_image_by_image():
    """Paired images: the first (where ``auto`` learns) apart from the mean of the others."""
    times = {name: bench.ModeTimes(seconds=seconds) for name, seconds in
             [("AR", [2.0, 2.0, 2.0]), (bench.EAGER_AR, [4.0, 4.0, 4.0]), ("auto", [2.5, 2.0, 1.0])]}
    modes = {"AR": bench.MODES["AR"], bench.EAGER_AR: bench.MODES["AR"], "auto": bench.MODES["auto"]}
    assert bench.against_ar_by_image(times, modes) == (
        "auto / AR by image: 0.80, 1.00, 2.00; mean 1.500 after the first image, 1.267 with it")
    assert bench.against_ar_by_image({"AR": times["AR"]}, {"AR": modes["AR"]}) == (
        "auto / AR by image: not measured (the run lacks one of the two)")
