"""The GPU check script runs end to end at toy size on the CPU and prints every measurement."""

import re

import torch

from sjd_core.tools import gpu_check

torch.set_num_threads(1)


def test_gpu_check_tiny_runs_and_reports(capsys):
    assert gpu_check.main(["--tiny", "--iterations", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("forward, 1 token:", "forward, 64-slot window:", "forward, PD tree (34 nodes):"):
        value = re.search(re.escape(label) + r"\s+([\d.]+) ms", out)
        assert value and float(value.group(1)) > 0, label
    for mode in ("ar", "pac+vp"):
        line = re.search(rf"^{re.escape(mode)}\s+3 iterations, (\d+) slots committed \(prefill [\d.]+ ms\): loop\s+([\d.]+) ms/it = "
                         r"forward\s+([\d.]+) \+ keep\s+([\d.]+) \+ engine outside the forward\s+([\d.-]+)",
                         out, re.M)
        assert line, mode
        committed, total, forward, keep, engine = (float(v) for v in line.groups())
        assert committed >= 3 and forward > 0 and engine > 0
        assert abs(total - (forward + keep + engine)) < 0.05
