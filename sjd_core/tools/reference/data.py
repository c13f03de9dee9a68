"""Fashion-MNIST, as Debian's ``dataset-fashion-mnist`` package installs it.

The reference model and its quality probe are trained on these files only. They are read with the
standard library and numpy (gzip-compressed IDX arrays), so training needs no download tool.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

DEFAULT_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
INSTALL_HINT = (
    "Install the data with `sudo apt-get install dataset-fashion-mnist` (Debian 11+ / Ubuntu 22.04+;"
    " MIT licence), which puts the four *-ubyte.gz files under /usr/share/datasets/fashion-mnist/,"
    " or pass --data DIR pointing at a folder holding train-images-idx3-ubyte.gz,"
    " train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz."
)
SPLITS = {"train": "train", "test": "t10k"}


def _read_idx(path: Path) -> np.ndarray:
    """Read one gzip-compressed IDX file (unsigned bytes) into an array of its stored shape."""
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    if raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (header {raw[:4]!r}).")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_split(split: str, data_dir: Path | str = DEFAULT_DATA_DIR) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(images, labels)`` of a split: uint8 (N, 28, 28) and int64 (N,)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed: split must be one of {tuple(SPLITS)}.")
    folder = Path(data_dir)
    images_path = folder / f"{SPLITS[split]}-images-idx3-ubyte.gz"
    labels_path = folder / f"{SPLITS[split]}-labels-idx1-ubyte.gz"
    missing = [str(p) for p in (images_path, labels_path) if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST files not found: {', '.join(missing)}. {INSTALL_HINT}")
    images = _read_idx(images_path)
    labels = _read_idx(labels_path).astype(np.int64)
    if images.shape[0] != labels.shape[0] or images.shape[1:] != (28, 28):
        raise ValueError(f"{folder}: expected N 28x28 images with N labels, got images "
                         f"{images.shape} and labels {labels.shape}.")
    return images, labels


def synthetic_split(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Small class-dependent 28x28 images (a bright bar whose position is the label), for tests."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count).astype(np.int64)
    images = (rng.random((count, 28, 28)) * 40).astype(np.uint8)
    for index, label in enumerate(labels):
        images[index, 2 + 2 * label: 5 + 2 * label, 4:24] = 220
    return images, labels
