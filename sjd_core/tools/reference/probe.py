"""Quality probe: a small classifier trained by the project on Fashion-MNIST.

No package ships Inception or CLIP weights, so the probe is the project's own CNN, trained on the
same data as the reference model (``train.py --parts classifier``). It reports, for a set of
generated images:

* ``accuracy``: how often the classifier's prediction equals the class the image was asked for;
* ``feature_distance``: the Frechet distance between Gaussian fits of the classifier's 64-d
  penultimate features of the images and of the 10,000 real test images (statistics stored with
  the weights). It is FID-like but NOT comparable to published FID numbers (other network, other
  data, other feature size) and it is biased upwards for small sample counts:
  :func:`real_floor` gives the value real test images reach at the same count.

It also offers a two-sample test between two sets of images (energy distance on the same
features, permutation p-value), which the benchmark uses to check that lossless modes draw
from the same distribution as plain autoregression.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...models.reference import codebook as cb

FEATURES = 64
FILE_NAME = "classifier.safetensors"
REAL_SAMPLE = 2000  # real test features stored with the probe, for the small-N floor


class ProbeClassifier(nn.Module):
    """Three conv blocks and a 64-d feature layer over 32x32 grey images."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 4 * 4, FEATURES), nn.ReLU(),
        )
        self.head = nn.Linear(FEATURES, 10)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 32, 32) images in [0, 1] -> (N, FEATURES)."""
        return self.body(images[:, None])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def as_grey(images: torch.Tensor) -> torch.Tensor:
    """Generated (N, H, W, 3) floats, (N, 32, 32) floats or (N, 28, 28) uint8 -> (N, 32, 32)."""
    if images.dtype == torch.uint8:
        images = torch.nn.functional.pad(images.float() / 255.0, (cb.PAD,) * 4)
    if images.ndim == 4:
        images = images.mean(-1)
    if tuple(images.shape[1:]) != (cb.IMAGE_SIZE, cb.IMAGE_SIZE):
        raise ValueError(f"the probe reads {cb.IMAGE_SIZE}x{cb.IMAGE_SIZE} images; got shape "
                         f"{tuple(images.shape)}.")
    return images.float()


def frechet_distance(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + tr(C1 + C2 - 2 (C1 C2)^(1/2)) for symmetric PSD C1, C2 (numpy only).

    tr((C1 C2)^(1/2)) = sum of sqrt(eigenvalues of C1^(1/2) C2 C1^(1/2)), a symmetric matrix.
    """
    values, vectors = np.linalg.eigh(cov1)
    root1 = (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T
    middle = np.linalg.eigvalsh(root1 @ cov2 @ root1)
    trace_root = np.sqrt(np.clip(middle, 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(cov1) + np.trace(cov2) - 2 * trace_root)


def energy_test(a: np.ndarray, b: np.ndarray, permutations: int = 2000, seed: int = 0
                ) -> tuple[float, float]:
    """Two-sample energy-distance test: returns (statistic, permutation p-value).

    Each sample is one image's feature vector, so samples are independent; the p-value is
    ``(1 + #{permuted >= observed}) / (1 + permutations)``.
    """
    pooled = np.concatenate([a, b]).astype(np.float64)
    dist = np.sqrt(((pooled[:, None, :] - pooled[None, :, :]) ** 2).sum(-1))
    n = len(a)
    rng = np.random.default_rng(seed)

    def statistic(order: np.ndarray) -> float:
        x, y = order[:n], order[n:]
        return 2 * dist[np.ix_(x, y)].mean() - dist[np.ix_(x, x)].mean() - dist[np.ix_(y, y)].mean()

    observed = statistic(np.arange(len(pooled)))
    count = sum(statistic(rng.permutation(len(pooled))) >= observed for _ in range(permutations))
    return float(observed), float((1 + count) / (1 + permutations))


class QualityProbe:
    """The trained classifier plus the feature statistics of the real test images."""

    def __init__(self, folder: Path | str) -> None:
        path = Path(folder) / FILE_NAME
        if not path.is_file():
            raise FileNotFoundError(f"quality probe weights not found at {path}; train them with "
                                    "`python -m sjd_core.tools.reference.train --parts classifier`.")
        state = load_file(str(path))
        self.real_mean = state.pop("real_feature_mean").double().numpy()
        self.real_cov = state.pop("real_feature_cov").double().numpy()
        self.real_sample = state.pop("real_feature_sample").double().numpy()
        self.net = ProbeClassifier()
        self.net.load_state_dict({k: v.float() for k, v in state.items()})
        self.net.eval()

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> np.ndarray:
        """(N, FEATURES) float64 features of generated or real images."""
        return self.net.features(as_grey(images.cpu())).double().numpy()

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> np.ndarray:
        """(N,) predicted class indices."""
        return self.net(as_grey(images.cpu())).argmax(-1).numpy()

    def evaluate(self, images: torch.Tensor, classes: list[int] | np.ndarray) -> dict:
        """``accuracy`` against the requested classes and ``feature_distance`` to real images."""
        classes = np.asarray(classes)
        if len(classes) != len(images) or len(images) < 2:
            raise ValueError(f"evaluate needs >= 2 images and one class per image; got "
                             f"{len(images)} images and {len(classes)} classes.")
        features = self.features(images)
        return {
            "accuracy": float((self.predict(images) == classes).mean()),
            "feature_distance": frechet_distance(features.mean(0), np.cov(features, rowvar=False),
                                                 self.real_mean, self.real_cov),
        }


def train_classifier(train_images: torch.Tensor, train_labels: torch.Tensor,
                     test_images: torch.Tensor, test_labels: torch.Tensor, out: Path,
                     steps: int, seed: int, batch: int = 128) -> float:
    """Train the probe, store it with the test images' feature statistics; returns test accuracy."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = ProbeClassifier()
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    images, test = as_grey(train_images), as_grey(test_images)
    started = time.time()
    order, cursor = torch.randperm(len(images), generator=generator), 0
    net.train()
    for _ in range(steps):
        if cursor + batch > len(order):
            order, cursor = torch.randperm(len(images), generator=generator), 0
        pick = order[cursor:cursor + batch]
        cursor += batch
        loss = nn.functional.cross_entropy(net(images[pick]), train_labels[pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    net.eval()
    with torch.no_grad():
        features = net.features(test).double()
        accuracy = (net.head(features.float()).argmax(-1) == test_labels).float().mean().item()
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in net.state_dict().items()}
    state["real_feature_mean"] = features.mean(0).float().contiguous()
    state["real_feature_cov"] = torch.from_numpy(np.cov(features.numpy(), rowvar=False)).float().contiguous()
    sample = torch.randperm(len(features), generator=generator)[:REAL_SAMPLE]
    state["real_feature_sample"] = features[sample].to(torch.float16).contiguous()
    save_file(state, str(Path(out) / FILE_NAME))
    print(f"probe classifier: test accuracy {accuracy:.4f} after {steps} steps in "
          f"{time.time() - started:.0f} s", flush=True)
    return accuracy


def real_floor(probe: QualityProbe, count: int, seed: int = 0) -> float:
    """Feature distance of ``count`` real test images: the best a generator can score at that N.

    Uses the features of real test images stored with the probe, so no dataset is needed.
    """
    if not 2 <= count <= len(probe.real_sample):
        raise ValueError(f"count={count} is not allowed: it must be in [2, {len(probe.real_sample)}].")
    pick = np.random.default_rng(seed).choice(len(probe.real_sample), size=count, replace=False)
    features = probe.real_sample[pick]
    return frechet_distance(features.mean(0), np.cov(features, rowvar=False), probe.real_mean,
                            probe.real_cov)
