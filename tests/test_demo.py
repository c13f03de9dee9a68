"""The main-job command and the heatmap pictures it draws."""

import numpy as np
import pytest
from PIL import Image

from sjd_core.tools import demo
from sjd_core.tools.figures import acceptance_figure, colourise, committed_together, heatmap, image_grid


def test_demo_writes_image_and_heatmap_and_reports_the_speedup(tmp_path, capsys):
    report = demo.main(["--prompt", "sneaker", "--out", str(tmp_path), "--window", "8",
                        "--device", "cpu"])
    image, figure = Image.open(report["image"]), Image.open(report["heatmap"])
    assert report["image"] == str(tmp_path / "sneaker.png")
    assert report["heatmap"] == str(tmp_path / "sneaker_heatmap.png")
    assert image.size == (260, 260)  # 32 px scaled 8x, 2 px border
    assert figure.size == (8 + 4 * (256 + 8), 28 + 256 + 16)  # image + three maps, 16 px per slot
    assert report["ar_nfe"] == 256 and report["nfe"] < 256
    printed = capsys.readouterr().out
    assert f"speed-up over AR: {report['speedup']:.2f}x wall-clock" in printed


def test_demo_rejects_unknown_prompts_and_bad_flags(tmp_path, capsys):
    with pytest.raises(ValueError, match="names no known class"):
        demo.main(["--prompt", "spaceship", "--out", str(tmp_path), "--no-baseline"])
    with pytest.raises(SystemExit):
        demo.main(["--batch", "0"])
    assert "--batch=0 is not allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--mode", "fastest"])


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
    figure = acceptance_figure(maps, image=np.zeros((8, 8, 3)), row=1, cell=10)
    assert figure.size == (8 + 4 * (40 + 8), 28 + 40 + 16)
    with pytest.raises(ValueError, match="row=2 is not allowed"):
        acceptance_figure(maps, row=2)
    with pytest.raises(ValueError, match="lacks"):
        acceptance_figure({"commit_iteration": maps["commit_iteration"]})
    together = committed_together(np.array([[[0, 0, 1], [2, 2, 2]], [[5, 6, 6], [6, 7, 7]]]))
    assert together.tolist() == [[[2, 2, 1], [3, 3, 3]], [[1, 3, 3], [3, 2, 2]]]
    grid = image_grid(np.ones((5, 4, 4, 3)), columns=2, scale=3, gap=1)
    assert grid.size == (2 * 12 + 3, 3 * 12 + 4)
