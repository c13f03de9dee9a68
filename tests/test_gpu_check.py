"""The GPU check runs end to end at toy size on the CPU and its table holds what it claims."""

import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from sjd_core.models.protocol import MemoryShape
from sjd_core.tools import bandwidth_floor, draw_check, gpu_check

torch.set_num_threads(1)
# the all-zero check of every draw is a read and four operations: off here
pytestmark = pytest.mark.usefixtures("without_device_checks")


@pytest.mark.slow
def test_gpu_check_tiny_prints_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert gpu_check.main(["--tiny", "--warmup", "2", "--iterations", "3", "--profiled", "1",
                           "--repeats", "1", "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    printed = capsys.readouterr().out
    forwards = [(f["nodes"], f["cache"]) for f in table["forwards"]]
    assert forwards == [(nodes, fill) for fill in ("empty", "half", "full")
                        for nodes in ("1 node", "16-node window", "34-node PAC tree",
                                      "64-node window")]
    cached = {f["cache"]: f["cached_codes"] for f in table["forwards"]}
    assert cached == {"empty": 0, "half": (48 * 48 - 64) // 2, "full": 48 * 48 - 64}
    for forward in table["forwards"]:
        assert forward["host_ms"] > 0 and forward["busy_ms"] is None  # no device here
    runs = {(run["mode"], run["compiled"], run["stages"]): run for run in table["runs"]}
    assert list(runs) == [(mode, compiled, stages) for mode in ("ar", "pac+vp", "auto")
                          for compiled, stages in ((False, False), (True, False), (True, True))]
    for (mode, _, stages), run in runs.items():
        # plain autoregression commits exactly one code per iteration and reads nothing back;
        # the speculative modes read one value per iteration; nobody waits on a copy to the device
        assert run["reads_per_iteration"] == {"ar": 0.0, "pac+vp": 1.0}.get(mode, run[
            "reads_per_iteration"]) and run["reads_per_iteration"] <= 1.0
        assert run["blocking_copies_per_iteration"] == 0.0
        assert run["codes_per_iteration"] >= 1.0
        assert 0 < run["host_ms_per_iteration"] <= run["ms_per_iteration"]
        assert run["busy_ms_per_iteration"] is None and run["warmup_seconds"] > 0
        assert f"| {gpu_check.run_name(run)} | {run['ms_per_iteration']:.2f} |" in printed
        if stages:  # compiled for real, not a fallback
            assert run["stage_graphs"]["failure"] is None and run["stage_graphs"]["graphs"] >= 1
            assert run["codes_compared"] > 0
    assert runs[("ar", False, False)]["codes_per_iteration"] == 1.0
    assert runs[("ar", True, False)]["codes_per_iteration"] == 1.0
    assert runs[("ar", True, True)]["codes_per_iteration"] == 1.0
    assert "| pac+vp compiled + stages | " in printed
    assert "codes per second against the faster" in printed
    assert table["peak_memory_gib"] is None  # no CUDA here
    _the_new_parts_are_there(table, printed)


def _the_new_parts_are_there(table: dict, printed: str) -> None:
    """The floor, every run against it, generate(), the projections and the draw check, in the
    JSON and in the printed table."""
    floor = table["floor"]
    assert floor["image_codes"] == 48 * 48 and floor["bandwidth_gb_s"] > 0
    assert floor["step_bytes"] == floor["weight_bytes"] + floor["cache_bytes"]
    assert floor["floor_ms"] == pytest.approx(floor["step_bytes"] / floor["bandwidth_gb_s"] / 1e6)
    assert floor["capacity_positions"] > floor["cached_positions"] > 48 * 48
    assert "memory-bandwidth floor: a copy of 256 MiB moved" in printed
    rows = {row["run"]: row for row in table["against_floor"]}
    assert list(rows) == [gpu_check.run_name(run) for run in table["runs"]]
    assert all(row["time"] == "wall" for row in rows.values())  # no busy time on the CPU
    assert "| wall (no device busy time here) ms / iteration | x floor |" in printed
    assert rows["ar compiled"]["ar_step_multiple"] == 1.0
    assert rows["ar compiled"]["targets"][0] == "x floor <= 1.5"
    assert "x compiled AR step <= 1.3" in rows["pac+vp compiled + stages"]["targets"]
    assert rows["ar compiled + stages"]["targets"] == ["x floor <= 1.5",
                                                       "s to first measured <= 120 cold"]
    assert rows["ar eager"]["targets"] == []
    assert table["generate"]["new_tokens"] == 16 and table["generate"]["ms_per_code"] > 0
    assert "transformers generate() (its own guidance" in printed
    projected = [row["decoding"] for row in table["projected"]["rows"]]
    assert projected == ["AR", "transformers generate()", "SJD", "SJD-PAC"]
    assert "projected image time, not measured" in printed and "| 4.51 (published) |" in printed
    check = table["draw_check"]
    assert check["passed"] and check["draws"] == 16384 and check["stages"]["failure"] is None
    assert "draw check (PAC+VP's stages, stages compiled" in printed and ": PASS:" in printed


def test_bandwidth_and_floor_arithmetic_on_known_numbers(monkeypatch):
    clock = iter(range(100))  # every synchronised copy takes one second of this clock
    monkeypatch.setattr(bandwidth_floor.time, "perf_counter", lambda: next(clock))
    assert bandwidth_floor.copy_bandwidth(torch.device("cpu"), 1000) == 2000.0  # read + written
    seven_b = MemoryShape(layers=32, heads=32, kv_heads=32, head_dim=128, hidden=4096,
                          intermediate=11008, dtype_bytes=2)
    assert seven_b.cache_bytes(1) == 2**19  # 512 KiB per cached position
    assert bandwidth_floor.mean_fill_positions(40, 3, 2304) == 40 + 3 + 2 * 1152
    floor = bandwidth_floor.StepFloor(weight_bytes=13 * 10**9, cache_bytes=10**9,
                                      bandwidth=2e12)
    assert floor.step_bytes == 14 * 10**9 and floor.floor_ms == pytest.approx(7.0)


def _run(mode: str, compiled: bool, stages: bool, wall: float, busy: float) -> dict:
    return {"mode": mode, "compiled": compiled, "stages": stages, "ms_per_iteration": wall,
            "host_ms_per_iteration": wall / 2, "busy_ms_per_iteration": busy,
            "warmup_seconds": 1.0}


def test_floor_multiples_and_projections_on_known_numbers():
    table = {"floor": {"floor_ms": 5.0, "image_codes": 2304},
             "runs": [_run("ar", False, False, 50.0, 7.0), _run("ar", True, False, 8.0, 7.5),
                      _run("pac+vp", True, False, 16.0, 10.0),
                      _run("pac+vp", True, True, 10.0, 9.0),
                      {"mode": "auto", "compiled": True, "stages": True, "error": "failed"}],
             "generate": {"ms_per_code": 60.0, "new_tokens": 64}}
    rows = {row["run"]: row for row in gpu_check.against_floor(table)}
    assert list(rows) == ["ar eager", "ar compiled", "pac+vp compiled", "pac+vp compiled + stages"]
    assert rows["ar compiled"]["floor_multiple"] == pytest.approx(1.5)  # busy 7.5 / floor 5
    assert rows["pac+vp compiled + stages"]["ar_step_multiple"] == pytest.approx(9.0 / 7.5)
    assert rows["pac+vp compiled"]["host_share"] == 0.5
    projected = {row["decoding"]: row for row in gpu_check.projections(table)["rows"]}
    assert projected["AR"]["timed_as"] == "ar compiled"  # the faster AR, wall-clock
    assert projected["AR"]["seconds"] == pytest.approx(2304 * 8.0 / 1e3)
    assert projected["transformers generate()"]["seconds"] == pytest.approx(2304 * 60.0 / 1e3)
    assert projected["SJD"]["timed_as"] == "pac+vp compiled + stages"  # the faster compiled row
    assert projected["SJD"]["seconds"] == pytest.approx(2304 / 2.22 * 10.0 / 1e3)
    assert projected["SJD-PAC"]["seconds"] == pytest.approx(2304 / 4.51 * 10.0 / 1e3)
    assert projected["SJD-PAC"]["speedup_vs_ar"] == pytest.approx(8.0 * 4.51 / 10.0)
    assert bandwidth_floor.projected_image_seconds(1000, 2.0, 4.0) == 2.0


def test_the_chi_square_fails_draws_from_another_distribution():
    cond, uncond = draw_check.bigram_tables(draw_check.VOCAB, torch.device("cpu"))
    target = draw_check.float64_target(cond, uncond, draw_check.SAMPLING)
    right = draw_check.pair_probabilities(target, draw_check.PAIR_SLOT)
    hotter = replace(draw_check.SAMPLING, temperature=1.1)
    wrong = draw_check.pair_probabilities(draw_check.float64_target(cond, uncond, hotter),
                                          draw_check.PAIR_SLOT)
    generator = torch.Generator().manual_seed(0)
    drawn = {name: torch.multinomial(probabilities, 16384, replacement=True, generator=generator)
             for name, probabilities in (("right", right), ("wrong", wrong))}
    assert draw_check.chi_square(drawn["right"], right)["passed"]
    assert not draw_check.chi_square(drawn["wrong"], right)["passed"]
    impossible = torch.nonzero(right == 0)[0]  # top-k leaves pairs of probability 0
    verdict = draw_check.chi_square(torch.cat([drawn["right"], impossible]), right)
    assert verdict["impossible_draws"] == 1 and verdict["p_value"] == 0.0


@pytest.mark.slow
def test_the_draw_check_fails_stages_fed_other_logits():
    cond, uncond = draw_check.bigram_tables(draw_check.VOCAB, torch.device("cpu"))
    exact = draw_check.pair_probabilities(
        draw_check.float64_target(cond, uncond, draw_check.SAMPLING), draw_check.PAIR_SLOT)
    drawn, report = draw_check.draw_pairs(cond, uncond, draw_check.SAMPLING, 8192)
    assert report["failure"] is None and draw_check.chi_square(drawn, exact)["passed"]
    skewed = cond + 0.2 * torch.randn(cond.shape, generator=torch.Generator().manual_seed(1))
    drawn, _ = draw_check.draw_pairs(skewed, uncond, draw_check.SAMPLING, 8192)
    verdict = draw_check.chi_square(drawn, exact)
    assert not verdict["passed"]
    assert "FAIL" in draw_check.describe({**verdict, "draws": 8192, "slots": [4, 5], "vocab": 8,
                                          "stages": report, "seconds": 1.0})


def test_an_iteration_that_compiles_after_the_warm_up_starts_the_measured_stretches_again():
    """A shape's first call past the warm-up (``auto`` feeding a new shape) can compile or
    record a graph, for seconds on a CPU: that iteration is no shape's cost. The stretches
    start again after it, as long as before."""
    originals = {name: torch.Tensor.__dict__.get(name) for name in gpu_check.ReadWait.METHODS}
    stretches = gpu_check._Stretches(torch.device("cpu"), 2, (3, 1, 1))
    codes = torch.zeros(1, 64, dtype=torch.long)

    def report(done: int, compiling: bool = False) -> SimpleNamespace:
        return SimpleNamespace(iteration=done, committed=[2 * done], compiling=compiling,
                               codes=codes)

    stretches.step(report(1))
    stretches.step(report(2))  # the warm-up is over: the timed stretch starts
    stretches.step(report(2, compiling=True))  # the third iteration compiles
    time.sleep(0.3)
    stretches.step(report(3))
    assert stretches.restarts == 1 and stretches.marks == (3, 6, 7, 8)
    with pytest.raises(gpu_check._Stop):
        for done in range(4, 9):
            stretches.step(report(done))
    seen = stretches.seen
    assert seen["ended"] - seen["began"] < 0.2
    assert seen["committed_end"] - seen["committed"] == 6 and seen["codes"].shape == (1, 16)
    stretches.leave()  # as run_mode does when the run ends
    assert {name: torch.Tensor.__dict__.get(name) for name in gpu_check.ReadWait.METHODS} == \
        originals  # the read counters are gone
    row = gpu_check._run_rows({"mode": "auto", "compiled": True, "stages": True, "network": None,
                               "stage_graphs": None, "ms_per_iteration": 1.0,
                               "host_ms_per_iteration": 1.0, "busy_ms_per_iteration": None,
                               "codes_per_iteration": 2.0, "reads_per_iteration": 1.0,
                               "blocking_copies_per_iteration": 0.0, "warmup_seconds": 1.0,
                               "restarts": stretches.restarts})
    assert row[-1] == ("|  | measured after 1 iteration that compiled past the warm-up (each "
                       "started the measured stretches again) |")


def test_the_counters_see_reads_and_blocking_copies():
    reads = gpu_check.HostReads()
    x = torch.arange(4)
    with reads:
        x.tolist()
        bool(x[0] > 0)
        x.to("meta")  # host memory to a device, waited for
        x.to("meta", non_blocking=True)  # not pinned: waited for too
        torch.empty(4, device="meta").copy_(x)
        x.to(torch.float32)  # stays on the host
    assert reads.count == 2 and reads.blocking_copies == 3


def test_without_cuda_the_full_check_says_how_to_run_the_smoke_test(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "--tiny" in capsys.readouterr().err
