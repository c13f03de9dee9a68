"""A small randomly initialised autoregressive image model behind the adapter protocol.

It is what the engine's tests and the synthetic benchmark run on: a causal transformer whose
conditionals depend on the prompt and on every earlier code, with classifier-free guidance (the
unconditional row sees no prompt), and a real key/value cache with the operations the engine
needs: appending a window or a draft tree under an ancestor mask, and keeping an arbitrary subset
of the fed entries per row. The engine has no special path for it.

The cache is static (gpt-fast style): each row has a fixed-capacity buffer and a write pointer on
the device, so keeping different numbers of entries per row needs no read back to the host.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..messages import quote
from .protocol import GenerationRequest, SamplingDefaults

_BYTES = 256


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, cache: "_StaticCache", layer: int,
                visible: torch.Tensor) -> torch.Tensor:
        rows, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(rows, length, 3, self.heads, -1).unbind(2)
        keys, values = cache.write(layer, k.transpose(1, 2), v.transpose(1, 2))
        attended = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=visible[:, None])
        x = x + self.out(attended.transpose(1, 2).reshape(rows, length, width))
        return x + self.mlp(self.norm2(x))


class _StaticCache:
    """Per-layer key/value buffers (rows, heads, capacity, dim) with a write pointer per row."""

    def __init__(self, layers: int, rows: int, heads: int, capacity: int, dim: int,
                 device: torch.device) -> None:
        shape = (rows, heads, capacity, dim)
        self.keys = [torch.zeros(shape, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device) for _ in range(layers)]
        self.length = torch.zeros(rows, dtype=torch.long, device=device)
        self.fed = 0

    def repeat_rows(self, copies: int, lengths: torch.Tensor) -> None:
        """Give each prefilled context ``copies`` consecutive rows, each ``lengths`` long."""
        self.keys = [k.repeat_interleave(copies, 0) for k in self.keys]
        self.values = [v.repeat_interleave(copies, 0) for v in self.values]
        self.length = lengths.repeat_interleave(copies)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new entries after each row's kept prefix; returns the whole buffers."""
        self.fed = k.shape[2]
        index = (self.length[:, None] + torch.arange(self.fed, device=k.device))
        index = index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.keys[layer].scatter_(2, index, k)
        self.values[layer].scatter_(2, index, v)
        return self.keys[layer], self.values[layer]

    def visible(self, ancestors: torch.Tensor) -> torch.Tensor:
        """(rows, T, capacity): the kept prefix plus the new entries allowed by ``ancestors``."""
        capacity = self.keys[0].shape[2]
        fed = ancestors.shape[-1]
        relative = torch.arange(capacity, device=ancestors.device) - self.length[:, None]
        new = (relative >= 0) & (relative < fed)
        tree = ancestors.expand(relative.shape[0], -1, -1).gather(
            2, relative.clamp(0, fed - 1)[:, None, :].expand(-1, fed, -1))
        return (relative < 0)[:, None, :] | (new[:, None, :] & tree)

    def keep(self, mask: torch.Tensor) -> None:
        """Keep the last fed entries where ``mask`` (rows, T) is True, in order; drop the rest."""
        rows, fed = mask.shape
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        source = self.length[:, None] + order
        target = self.length[:, None] + torch.arange(fed, device=mask.device)
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                heads, dim = buffer.shape[1], buffer.shape[3]
                moved = buffer.gather(2, source[:, None, :, None].expand(-1, heads, -1, dim))
                buffer.scatter_(2, target[:, None, :, None].expand(-1, heads, -1, dim), moved)
        self.length = self.length + mask.sum(1)


class SyntheticSession:
    """Decoding session of :class:`SyntheticModel`: cond rows, then uncond rows when guided."""

    def __init__(self, model: "SyntheticModel", request: GenerationRequest) -> None:
        self.model = model
        self.batch_size = request.batch_size
        self.grid_height, self.grid_width = model.grid_for(request.resolution)
        self.guided = request.guidance != 1.0
        contexts = [model.prompt_tokens(request.prompt)]
        if self.guided:
            contexts.append(model.prompt_tokens(request.negative_prompt))
        longest = max(len(c) for c in contexts)
        slots = self.grid_height * self.grid_width
        self.cache = _StaticCache(len(model.blocks), len(contexts), model.heads,
                                  longest + slots + model.max_fed + 1, model.width // model.heads,
                                  model.device)
        padded = torch.tensor([c + [0] * (longest - len(c)) for c in contexts], device=model.device)
        positions = torch.arange(longest, device=model.device).expand(len(contexts), -1)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=model.device).tril()
        with torch.inference_mode():
            model.run(self.cache, padded, positions, causal)
        lengths = torch.tensor([len(c) for c in contexts], device=model.device)
        self.cache.repeat_rows(self.batch_size, lengths)
        self.prefix = self.cache.length.clone()

    def forward(self, codes: torch.Tensor, slots: torch.Tensor, ancestors: torch.Tensor,
                committed=None, mark=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        model = self.model
        copies = 2 if self.guided else 1
        codes, slots = codes.repeat(copies, 1), slots.repeat(copies, 1)
        tokens = torch.where(slots < 0, model.begin_token, codes)
        positions = self.prefix[:, None] + 1 + slots
        if mark is not None:
            mark()
        with torch.inference_mode():
            logits = model.run(self.cache, tokens, positions, ancestors)
        if mark is not None:
            mark()
        if not self.guided:
            return logits, None
        return logits[: self.batch_size], logits[self.batch_size:]

    def keep(self, mask: torch.Tensor) -> None:
        self.cache.keep(mask.repeat(2 if self.guided else 1, 1))

    def retain(self, rows) -> None:
        keep = list(rows) + ([r + self.batch_size for r in rows] if self.guided else [])
        index = torch.tensor(keep, device=self.prefix.device)
        self.cache.keys = [k[index] for k in self.cache.keys]
        self.cache.values = [v[index] for v in self.cache.values]
        self.cache.length, self.prefix = self.cache.length[index], self.prefix[index]
        self.batch_size = len(rows)


class SyntheticModel(nn.Module):
    """Random causal transformer over ``codebook_size`` codes on a ``grid`` of slots.

    The prompt is read byte by byte, so different prompts give different images; the
    unconditional context is the negative prompt's bytes (empty by default). ``sharpness``
    scales the output logits: larger values make conditionals more peaked.
    """

    family = "synthetic"

    def __init__(self, codebook_size: int = 16, grid: tuple[int, int] = (4, 4), width: int = 32,
                 layers: int = 1, heads: int = 2, sharpness: float = 1.0, max_fed: int = 128,
                 seed: int = 0, device: str | torch.device = "cpu") -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.codebook_size = codebook_size
        self.grid = grid
        self.width, self.heads = width, heads
        self.max_fed = max_fed
        self.begin_token = codebook_size
        self.null_token = codebook_size + 1
        self.byte_offset = codebook_size + 2
        self.max_positions = 64 + grid[0] * grid[1] + 1
        self.embed = nn.Embedding(codebook_size + 2 + _BYTES, width)
        self.position = nn.Embedding(self.max_positions, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, codebook_size)
        with torch.no_grad():
            self.embed.weight.mul_(2.0)
            self.head.weight.mul_(sharpness * math.sqrt(width) / 4)
        torch.random.set_rng_state(generator_state)
        self.device = torch.device(device)
        self.to(self.device).eval()
        self.defaults = SamplingDefaults(guidance=3.0, temperature=1.0, top_k=0)

    def supported_resolutions(self) -> list[tuple[int, int]]:
        return [(self.grid[1], self.grid[0])]

    def grid_for(self, resolution: tuple[int, int] | None) -> tuple[int, int]:
        if resolution is not None and tuple(resolution) != self.supported_resolutions()[0]:
            raise ValueError(f"resolution={quote(resolution)} is not supported by the synthetic model; "
                             f"supported: {self.supported_resolutions()}")
        return self.grid

    def codebook_embeddings(self) -> torch.Tensor:
        return self.embed.weight[: self.codebook_size].detach()

    def prompt_tokens(self, text: str) -> list[int]:
        """A start token, then up to 48 bytes of ``text`` (the prompt, or the negative prompt)."""
        data = list(text.encode("utf-8")[:48])
        return [self.null_token] + [self.byte_offset + b for b in data]

    def start(self, request: GenerationRequest) -> SyntheticSession:
        return SyntheticSession(self, request)

    def run(self, cache: _StaticCache, tokens: torch.Tensor, positions: torch.Tensor,
            ancestors: torch.Tensor) -> torch.Tensor:
        """Feed tokens at positions through every layer; returns codebook logits (float32)."""
        x = self.embed(tokens) + self.position(positions.clamp(0, self.max_positions - 1))
        visible = cache.visible(ancestors)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer, visible)
        return self.head(self.norm(x)).float()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """A grey level per code: (B, H, W) -> (B, H, W, 3) in [0, 1]."""
        level = codes.float() / max(self.codebook_size - 1, 1)
        return level[..., None].expand(*codes.shape, 3).clone()
