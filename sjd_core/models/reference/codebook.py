"""The reference model's image tokenizer: a k-means codebook over 2x2 pixel patches.

A 28x28 grey image is padded to 32x32 and cut into a 16x16 grid of 2x2 patches; each patch becomes
the index of its nearest codebook entry. Decoding looks the entries up and puts the patches back.
The codebook plays the part of a real model's VQ decoder, and its entries (the 4 pixel values of
each code) are the code embeddings that relaxed acceptance compares.
"""

from __future__ import annotations

import torch

IMAGE_SIZE = 32
PATCH = 2
PAD = (IMAGE_SIZE - 28) // 2
GRID = IMAGE_SIZE // PATCH


def to_patches(images: torch.Tensor) -> torch.Tensor:
    """(N, 28, 28) uint8 or (N, 32, 32) float images -> (N, GRID*GRID, PATCH*PATCH) floats in [0, 1]."""
    if images.dtype == torch.uint8:
        images = images.float() / 255.0
    if images.shape[-1] == 28:
        images = torch.nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    n = images.shape[0]
    grid = images.reshape(n, GRID, PATCH, GRID, PATCH).permute(0, 1, 3, 2, 4)
    return grid.reshape(n, GRID * GRID, PATCH * PATCH)


def from_patches(patches: torch.Tensor, grid_h: int = GRID, grid_w: int = GRID) -> torch.Tensor:
    """(N, grid_h*grid_w, PATCH*PATCH) -> (N, grid_h*PATCH, grid_w*PATCH) images."""
    n = patches.shape[0]
    grid = patches.reshape(n, grid_h, grid_w, PATCH, PATCH).permute(0, 1, 3, 2, 4)
    return grid.reshape(n, grid_h * PATCH, grid_w * PATCH)


def nearest(points: torch.Tensor, centroids: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    """Index of the nearest centroid (squared Euclidean) for each row of ``points`` (P, D)."""
    out = torch.empty(points.shape[0], dtype=torch.long)
    c_norm = (centroids * centroids).sum(1)
    for start in range(0, points.shape[0], chunk):
        block = points[start:start + chunk]
        dist = c_norm[None, :] - 2 * block @ centroids.T
        out[start:start + chunk] = dist.argmin(1)
    return out


def kmeans(points: torch.Tensor, k: int, iterations: int, generator: torch.Generator) -> torch.Tensor:
    """Lloyd's k-means with k-means++ seeding; centroids returned sorted by mean brightness.

    Sorting makes code indices meaningful (0 is the darkest patch) and the result independent of
    the order in which centroids were found.
    """
    p = points.shape[0]
    centroids = torch.empty(k, points.shape[1])
    centroids[0] = points[torch.randint(p, (1,), generator=generator)]
    best = ((points - centroids[0]) ** 2).sum(1)
    for index in range(1, k):
        weights = best if best.sum() > 0 else torch.ones(p)
        pick = torch.multinomial(weights, 1, generator=generator)
        centroids[index] = points[pick]
        best = torch.minimum(best, ((points - centroids[index]) ** 2).sum(1))
    for _ in range(iterations):
        assign = nearest(points, centroids)
        sums = torch.zeros_like(centroids).index_add_(0, assign, points)
        counts = torch.bincount(assign, minlength=k).float()
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
    order = centroids.mean(1).argsort(stable=True)
    return centroids[order].contiguous()


def encode(images: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """(N, 28, 28) uint8 images -> (N, GRID, GRID) long codes."""
    patches = to_patches(images)
    codes = nearest(patches.reshape(-1, patches.shape[-1]), codebook)
    return codes.reshape(images.shape[0], GRID, GRID)


def decode(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """(N, H, W) codes -> (N, H*PATCH, W*PATCH) float images in [0, 1]."""
    n, grid_h, grid_w = codes.shape
    patches = codebook[codes.reshape(n, -1).to(codebook.device)]
    return from_patches(patches, grid_h, grid_w).clamp(0.0, 1.0)
