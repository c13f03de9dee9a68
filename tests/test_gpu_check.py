"""The GPU check runs end to end at toy size on the CPU and its table holds what it claims."""

import json

import pytest
import torch

from sjd_core.tools import gpu_check

torch.set_num_threads(1)
# the all-zero check of every draw is a read and four operations: off here
pytestmark = pytest.mark.usefixtures("unchecked_draws")


def test_gpu_check_tiny_prints_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert gpu_check.main(["--tiny", "--iterations", "4", "--repeats", "1", "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert list(table["forward_ms"]) == ["1 token", "16-node window", "34-node PAC tree",
                                         "64-node window"]
    assert all(ms > 0 for ms in table["forward_ms"].values())
    runs = {run["mode"]: run for run in table["runs"]}
    assert list(runs) == ["ar", "pac+vp", "auto"]
    # plain autoregression commits exactly one code per iteration and reads nothing back
    assert runs["ar"]["codes_per_iteration"] == 1.0
    assert runs["ar"]["host_reads_per_iteration"] == 0.0
    assert runs["pac+vp"]["host_reads_per_iteration"] == 1.0
    assert runs["auto"]["host_reads_per_iteration"] <= 1.0
    assert runs["pac+vp"]["codes_per_iteration"] >= 1.0
    for run in runs.values():
        assert run["ms_per_iteration"] > 0 and 0 < run["outside_share"] < 1
        assert f"| {run['mode']} | {run['ms_per_iteration']:.2f} |" in printed
    assert table["ar_ms_per_code"] == runs["ar"]["ms_per_iteration"]
    assert table["peak_memory_gib"] is None  # no CUDA here


def test_without_cuda_the_full_check_says_how_to_run_the_smoke_test(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    assert "--tiny" in capsys.readouterr().err
