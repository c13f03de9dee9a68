"""A small randomly initialised autoregressive image model behind the adapter protocol.

It is what the engine's tests and the synthetic benchmark run on: a causal transformer whose
conditionals depend on the prompt and on every earlier code, with classifier-free guidance (the
unconditional row sees no prompt), and a real key/value cache with the operations the engine
needs: appending a window or a draft tree under an ancestor mask, and keeping an arbitrary subset
of the fed entries per row. The engine has no special path for it.

Its session is the shared :class:`~.session.slot_session.SlotSession`, the one every transformers
family uses too: a preallocated cache written in place, a persistent (boolean) attention mask, and
a token layout without structural tokens. A row's whole prompt is its context; the slot -1 token
is the model's begin token right after it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..messages import quote
from .protocol import GenerationRequest, MemoryShape, SamplingDefaults
from .session.kv_store import KVStore
from .session.slot_session import Fed, SlotSession

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

    def forward(self, x: torch.Tensor, store: KVStore, layer: int, mask: torch.Tensor | None
                ) -> torch.Tensor:
        rows, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(rows, length, 3, self.heads, -1).unbind(2)
        keys, values = store.update(layer, k.transpose(1, 2), v.transpose(1, 2))
        attended = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                                    attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(rows, length, width))
        return x + self.mlp(self.norm2(x))


class SyntheticSession(SlotSession):
    """Decoding session of :class:`SyntheticModel`: cond rows, then uncond rows when guided."""

    def __init__(self, model: "SyntheticModel", request: GenerationRequest) -> None:
        self.model = model
        guided = request.guidance != 1.0
        contexts = [model.prompt_tokens(request.prompt)] * request.batch_size
        if guided:
            contexts += [model.prompt_tokens(request.negative_prompt)] * request.batch_size
        lengths = [len(c) for c in contexts]
        super().__init__(batch_size=request.batch_size, guided=guided,
                         grid=model.grid_for(request.resolution), row_end=False, prefix=lengths,
                         start=lengths, max_nodes=request.max_nodes, device=model.device,
                         mask_dtype=torch.bool)
        longest = max(lengths)
        padded = torch.zeros(len(contexts), longest, dtype=torch.long, device=model.device)
        for row, context in enumerate(contexts):
            padded[row, self.context_columns(row, len(context))] = torch.tensor(context)
        with torch.no_grad():
            self._prefill(padded)

    def _inputs(self, codes: torch.Tensor, fed: Fed | None) -> torch.Tensor:
        tokens = torch.cat([codes, codes]) if self.guided else codes
        starting = None if fed is None else fed.part("starting")
        if starting is not None:  # node 0 of these rows is the slot -1 token: the begin token
            first = torch.where(starting, self.model.begin_token, tokens[:, 0])
            tokens = torch.cat([first[:, None], tokens[:, 1:]], 1)
        return tokens

    def _run(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
             ) -> torch.Tensor:
        return self.model.run(self.store, inputs, positions, mask)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.head(hidden).float()


RECIPE = "synthetic"  # the name of the model's one recipe


class SyntheticModel(nn.Module):
    """Random causal transformer over ``codebook_size`` codes on a ``grid`` of slots.

    The prompt is read byte by byte, so different prompts give different images; the
    unconditional context is the negative prompt's bytes (empty by default). ``sharpness``
    scales the output logits: larger values make conditionals more peaked.
    """

    family = "synthetic"

    def __init__(self, codebook_size: int = 16, grid: tuple[int, int] = (4, 4), width: int = 32,
                 layers: int = 1, heads: int = 2, sharpness: float = 1.0,
                 seed: int = 0, device: str | torch.device = "cpu") -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.codebook_size = codebook_size
        self.grid = grid
        self.width, self.heads = width, heads
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
        self.memory_shape = MemoryShape(layers=layers, heads=heads, kv_heads=heads,
                                        head_dim=width // heads, hidden=width,
                                        intermediate=4 * width, dtype_bytes=4)
        self.recipes = {RECIPE: SamplingDefaults(guidance=3.0, temperature=1.0, top_k=0)}
        self.defaults = self.recipes[RECIPE]

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

    def run(self, store: KVStore, tokens: torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
        """Feed tokens at positions through every layer, caching in ``store``; final hidden states.

        ``mask`` (rows, 1, tokens, columns) booleans say which of the cache's first columns each
        token sees; None: every column the store hands back.
        """
        x = self.embed(tokens) + self.position(positions.clamp(0, self.max_positions - 1))
        for layer, block in enumerate(self.blocks):
            x = block(x, store, layer, mask)
        return self.norm(x)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """A grey level per code: (B, H, W) -> (B, H, W, 3) in [0, 1]."""
        level = codes.float() / max(self.codebook_size - 1, 1)
        return level[..., None].expand(*codes.shape, 3).clone()
