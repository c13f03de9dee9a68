"""The small pieces LlamaGen needs on top of a stock ``LlamaForCausalLM``.

LlamaGen's GPT is a Llama decoder with three differences, each a module here:

- its rotary embedding is two-dimensional: for image slot ``(r, c)`` of a ``g x g`` grid the
  first half of each head's rotation pairs turn by ``r * f_i`` and the second half by ``c * f_i``
  with ``f_i = base ** (-2i / (head_dim / 2))``; the conditioning positions in front of the image
  have ``cos = sin = 0`` in LlamaGen's table, which zeroes their queries and keys (so every query
  gives them an attention score of exactly 0). :class:`LlamaGenRotary` is that table, looked up by
  position id, in the rotate-half layout the stock Llama attention uses;
- class-conditional models embed the class (index ``num_classes`` is the null class used for
  guidance): :class:`ClassEmbedder`;
- text-conditional models project FLAN-T5 caption features with a two-layer MLP and keep a learned
  null caption: :class:`CaptionEmbedder`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


def rope_2d_angles(grid_size: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """(grid_size**2, head_dim // 2) rotation angles of LlamaGen's 2D RoPE, raster order.

    Pair ``j < head_dim // 4`` turns with the row index, the others with the column index.
    """
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.float32)[: half // 2] / half))
    index = torch.arange(grid_size, dtype=torch.float32)
    rows = torch.outer(index, freqs)[:, None, :].expand(grid_size, grid_size, -1)
    cols = torch.outer(index, freqs)[None, :, :].expand(grid_size, grid_size, -1)
    return torch.cat([rows, cols], dim=-1).reshape(grid_size * grid_size, half)


class LlamaGenRotary(nn.Module):
    """Replaces ``LlamaModel.rotary_emb``: (cos, sin) of LlamaGen's 2D table by position id.

    Position ``p < cond_tokens`` is a conditioning token (cos = sin = 0, as in LlamaGen's table);
    position ``cond_tokens + k`` is image slot ``k``. Positions past the table are an error of
    the caller, reported by the index lookup.
    """

    def __init__(self, grid_size: int, head_dim: int, cond_tokens: int, base: float = 10000.0):
        super().__init__()
        angles = rope_2d_angles(grid_size, head_dim, base)
        cos = torch.cat([torch.zeros(cond_tokens, head_dim // 2), angles.cos()])
        sin = torch.cat([torch.zeros(cond_tokens, head_dim // 2), angles.sin()])
        # rotate-half layout: the two members of pair j sit at j and j + head_dim // 2
        self.register_buffer("cos_table", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin_table", torch.cat([sin, sin], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) position ids -> cos, sin of shape (B, T, head_dim) in ``x``'s dtype."""
        cos = self.cos_table.to(x.device)[position_ids]
        sin = self.sin_table.to(x.device)[position_ids]
        return cos.to(x.dtype), sin.to(x.dtype)


class ClassEmbedder(nn.Module):
    """Class label -> one conditioning embedding; label ``num_classes`` is the null class."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        """(B,) labels -> (B, 1, dim)."""
        return self.embedding_table(labels).unsqueeze(1)


class CaptionEmbedder(nn.Module):
    """FLAN-T5 caption features (B, tokens, caption_dim) -> (B, tokens, dim); holds the null caption."""

    def __init__(self, caption_dim: int, dim: int, tokens: int):
        super().__init__()
        self.fc1 = nn.Linear(caption_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)
        # a parameter (not a buffer) so checkpoint loaders that fill parameters fill it too
        self.uncond_embedding = nn.Parameter(torch.zeros(tokens, caption_dim), requires_grad=False)

    def forward(self, captions: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(captions), approximate="tanh"))


class LlamaGenTransformer(LlamaForCausalLM):
    """A stock ``LlamaForCausalLM`` carrying LlamaGen's 2D rotary table and conditioning embedder.

    ``config.llamagen`` holds what Llama's config cannot: ``kind`` (``c2i``/``t2i``), ``grid_size``,
    ``cond_tokens``, ``num_classes``, ``caption_dim`` and ``rope_base``.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        extra = config.llamagen
        head_dim = config.hidden_size // config.num_attention_heads
        self.model.rotary_emb = LlamaGenRotary(extra["grid_size"], head_dim, extra["cond_tokens"],
                                               extra["rope_base"])
        if extra["kind"] == "c2i":
            self.cond_embedder: nn.Module = ClassEmbedder(extra["num_classes"], config.hidden_size)
        else:
            self.cond_embedder = CaptionEmbedder(extra["caption_dim"], config.hidden_size,
                                                 extra["cond_tokens"])
