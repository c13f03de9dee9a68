"""One decoding session over any transformers decoder, shared by every model family.

A family adapter describes itself with :class:`DecoderParts` (how a code becomes an input
embedding, how hidden states become codebook logits, its row-end token, its slot -> position map)
and the prefill :class:`Context` of each conditional and unconditional row; :class:`HFSession`
does the rest of the :class:`~sjd_core.models.protocol.DecodingSession` contract:

* one ``DynamicCache`` for all rows: the conditional contexts are rows ``0..B-1``, the
  unconditional ones (when guidance is on) rows ``B..2B-1``, run in ONE batched forward. Contexts
  of different lengths are left-padded; every forward passes an explicit per-row additive float
  mask (0 = attend, ``finfo(dtype).min`` = blocked) and explicit ``position_ids``;
* tree attention: the engine's (T, T) ``ancestors`` matrix becomes a token-level mask, with the
  structural tokens (row ends) inserted after code nodes whose slot ends a grid row;
* per-row cache validity, so rows may keep different numbers of entries (see :meth:`keep`);
* a node's output is read at the last token fed for it, so the output of a code that ends a row
  is the model's prediction after the row-end token: the next row's first code.

Sequence layout of one row: ``prefill... | s(-1) | code(0) ... code(W-1) [row end] | code(W) ...``
where ``s(-1)`` is the last token of the row's context (the model's begin-of-image token, or the
class embedding): the prefill runs everything before it and the engine feeds it as slot -1.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from .protocol import DecodingSession

__all__ = ["Context", "DecoderParts", "HFSession", "raster_offsets", "tree_token_mask"]


@dataclass(frozen=True)
class Context:
    """One row's prefill: token ids (1-D) or input embeddings ((n, dim)); n >= 1.

    Its last element is the slot -1 token: the engine feeds it, the prefill runs the rest.
    """

    ids: torch.Tensor | None = None
    embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.ids is None) == (self.embeds is None):
            raise ValueError("Context needs exactly one of ids or embeds.")
        n = len(self.ids) if self.ids is not None else self.embeds.shape[0]
        if n < 1:
            raise ValueError("Context must hold at least the slot -1 token (got an empty one).")

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else self.embeds.shape[0]


def raster_offsets(slots: torch.Tensor, grid_width: int, row_end: bool) -> torch.Tensor:
    """Sequence offset of each slot after the slot -1 token, with a row-end token after each row."""
    offsets = slots + 1
    if row_end:
        offsets = offsets + torch.div(slots.clamp(min=0), grid_width, rounding_mode="floor")
    return offsets


@dataclass
class DecoderParts:
    """The family-specific pieces of a transformers decoder.

    backbone: module called as ``backbone(inputs_embeds=, attention_mask=, position_ids=, cache=,
        use_cache=True)`` returning an object with ``last_hidden_state`` (a ``LlamaModel``,
        ``ChameleonModel``, Janus's ``language_model``...). It must use ``sdpa`` or ``eager``
        attention (flash attention cannot express tree masks).
    embed_tokens: token ids (any shape) -> input embeddings (shape + (dim,)).
    embed_codes: image codes (R, T) -> input embeddings (R, T, dim); an id offset or a separate
        image embedding path.
    code_logits: hidden states (R, T, hidden) -> logits (R, T, codebook_size) over the codebook.
    row_end_id: the token fed after the last code of every grid row, or None.
    slot_offsets: (slots, grid_width, has_row_end) -> sequence offset after the slot -1 token.
    cache_config: config handed to ``DynamicCache`` (the decoder's config), or None.
    device: where input tensors are built (with a ``device_map``, the first module's device).
    dtype: the model's compute dtype (masks and embeddings use it).
    """

    backbone: nn.Module
    embed_tokens: Callable[[torch.Tensor], torch.Tensor]
    embed_codes: Callable[[torch.Tensor], torch.Tensor]
    code_logits: Callable[[torch.Tensor], torch.Tensor]
    row_end_id: int | None
    device: torch.device
    dtype: torch.dtype
    cache_config: object | None = None
    slot_offsets: Callable[[torch.Tensor, int, bool], torch.Tensor] = raster_offsets


def tree_token_mask(ancestors: torch.Tensor, node_of: torch.Tensor, real: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Additive (R, 1, N, N) mask among fed tokens.

    Token t sees token u when u's node is an ancestor of (or is) t's node, except that a node's
    row-end token is hidden from the node's own code token (u after t within one node). Padding
    tokens (``real`` False) see only themselves, so no query row is fully blocked.
    """
    n = node_of.shape[1]
    node = node_of.clamp(min=0)
    anc = ancestors.to(node.device)[node[:, :, None], node[:, None, :]]  # (R, N, N)
    order = torch.arange(n, device=node.device)
    same_node = node[:, :, None] == node[:, None, :]
    allowed = anc & ~(same_node & (order[None, None, :] > order[None, :, None]))
    allowed = allowed & real[:, :, None] & real[:, None, :]
    allowed = allowed | torch.eye(n, dtype=torch.bool, device=node.device)
    return _additive(allowed, dtype)[:, None]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    blocked = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, blocked)


def _to_host_async(values: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Start copying ``values`` to the host; returns the host tensor and an event to wait on."""
    if values.device.type == "cpu":
        return values, None
    if values.device.type != "cuda":
        return values.to("cpu"), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(values.device))
    return host, ready


class HFSession(DecodingSession):
    """A prefilled cache for ``B`` images (and their unconditional rows) on a transformers decoder.

    Per-row cache validity: rows of one batch share a cache length, but each row keeps its own
    set of valid entries (a bool (R, L) map, passed to attention as part of the mask). Left
    padding of the prefill and entries a row did not keep while another row did are *dead*
    entries: they cost memory and attention work but are never attended to. When dead entries
    exceed a quarter of the cache (and at least 64), the cache is compacted per row (one gather
    per layer, O(cache) memory traffic).

    No device->host read on the hot path: ``keep`` starts an asynchronous copy of a few counts
    (tokens and nodes kept per row), which the next ``forward`` uses to crop the cache to its
    longest row. The token layout of a forward (how many row ends it inserts) is sized on the
    host from those counts and the tree's depths, assuming the protocol's slot rule: a node's
    slot is the row's first uncached slot plus its depth in the tree (slots past the grid are
    clamped). The depths are read once per distinct ``ancestors`` tensor. A forward whose slots
    break the rule and need more row ends than that fails an assertion on the device.
    """

    compact_min = 64

    def __init__(self, parts: DecoderParts, cond: list[Context], uncond: list[Context] | None,
                 grid: tuple[int, int]) -> None:
        if uncond is not None and len(uncond) != len(cond):
            raise ValueError(f"uncond has {len(uncond)} contexts, cond has {len(cond)}: need one per image.")
        self.parts = parts
        self.batch_size = len(cond)
        self.grid_height, self.grid_width = grid
        self.guided = uncond is not None
        contexts = list(cond) + (list(uncond) if uncond is not None else [])
        self._rows = len(contexts)
        self._cache = DynamicCache(config=parts.cache_config)
        self._valid = torch.zeros(self._rows, 0, dtype=torch.bool, device=parts.device)
        self._pending: tuple[torch.Tensor, object] | None = None  # counts of the last keep, copy event
        self._base_len = 0  # cache length before the last forward's region
        self._cached_nodes = np.zeros(self.batch_size, dtype=np.int64)  # host: nodes kept per image
        self._depths: tuple | None = None  # (weakref to ancestors, its version, host depths)
        self._fed: tuple[torch.Tensor, torch.Tensor] | None = None  # (token node, real) of last forward
        self._prefill(contexts)

    # ----------------------------------------------------------------------------- prefill
    def _embed(self, ctx: Context) -> torch.Tensor:
        if ctx.embeds is not None:
            return ctx.embeds.to(self.parts.device, self.parts.dtype)
        return self.parts.embed_tokens(ctx.ids.to(self.parts.device)).to(self.parts.dtype)

    @torch.no_grad()
    def _prefill(self, contexts: list[Context]) -> None:
        dev, dtype = self.parts.device, self.parts.dtype
        embeds = [self._embed(c) for c in contexts]
        self._start = torch.stack([e[-1] for e in embeds])  # (R, dim) slot -1 inputs
        lengths = torch.tensor([len(c) - 1 for c in contexts], device=dev)
        self._base = lengths.clone()  # position of the slot -1 token per row
        n = int(max(len(c) for c in contexts)) - 1
        if n == 0:
            return
        dim = self._start.shape[-1]
        x = torch.zeros(self._rows, n, dim, dtype=dtype, device=dev)
        for r, e in enumerate(embeds):  # once per context, not per slot
            if len(e) > 1:
                x[r, n - (len(e) - 1):] = e[:-1]
        col = torch.arange(n, device=dev)
        real = col[None, :] >= (n - lengths)[:, None]
        positions = (col[None, :] - (n - lengths)[:, None]).clamp(min=0)
        causal = col[None, :, None] >= col[None, None, :]
        allowed = (causal & real[:, None, :] & real[:, :, None]) | torch.eye(n, dtype=torch.bool, device=dev)
        self._run(x, _additive(allowed, dtype)[:, None], positions)
        self._valid = real

    # ----------------------------------------------------------------------------- forward
    def _run(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.parts.backbone(inputs_embeds=x, attention_mask=mask, position_ids=positions,
                                  cache=self._cache, use_cache=True)
        return out.last_hidden_state

    def _crop_to(self, length: int) -> None:
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self._valid = self._valid[:, :length]

    def _compact(self, length: int) -> None:
        """Move each row's valid entries to the front, ``length`` = the largest per-row count.

        Order does not matter to attention: each entry's position is already rotated into its key.
        """
        count = self._valid.sum(1)
        order = torch.sort((~self._valid).to(torch.int8), dim=1, stable=True).indices[:, :length]
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                idx = order.to(layer.keys.device)[:, None, :, None]
                idx = idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
                layer.keys = layer.keys.gather(2, idx)
                layer.values = layer.values.gather(2, idx)
        self._valid = torch.arange(length, device=count.device)[None, :] < count[:, None]

    def _apply_pending(self) -> None:
        """Crop (and maybe compact) the cache with the counts the last ``keep`` sent to the host."""
        host, ready = self._pending
        self._pending = None
        if ready is not None:
            ready.synchronize()  # long done in practice: the engine reads its own results first
        counts, rows = host.numpy(), self._rows
        kept, valid, nodes = counts[:rows], counts[rows:2 * rows], counts[2 * rows:]
        self._cached_nodes += nodes
        length, longest = self._base_len + int(kept.max()), int(valid.max())
        self._crop_to(length)
        if length - longest > max(self.compact_min, length // 4):
            self._compact(longest)

    def _row_ends_needed(self, ancestors: torch.Tensor) -> int:
        """Most row-end tokens any row needs this forward, from host-side state only."""
        if self.parts.row_end_id is None:
            return 0
        known = self._depths
        if known is None or known[0]() is not ancestors or known[1] != ancestors._version:
            depths = ancestors.to("cpu", torch.long).sum(1).numpy() - 1  # once per tree
            self._depths = known = (weakref.ref(ancestors), ancestors._version, depths)
        w, last = self.grid_width, self.grid_height * self.grid_width - 1
        slots = np.minimum((self._cached_nodes - 1)[:, None] + known[2][None, :], last)
        return int(((slots >= 0) & (slots % w == w - 1)).sum(1).max())

    @torch.no_grad()
    def forward(self, codes: torch.Tensor, slots: torch.Tensor, ancestors: torch.Tensor,
                committed=None, mark=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``codes`` at ``slots`` (B, T) under the (T, T) ``ancestors`` mask; see the protocol."""
        p, dev = self.parts, self.parts.device
        b, t = codes.shape
        if b != self.batch_size or slots.shape != codes.shape or tuple(ancestors.shape) != (t, t):
            raise ValueError(f"forward got codes {tuple(codes.shape)}, slots {tuple(slots.shape)}, "
                             f"ancestors {tuple(ancestors.shape)}; expected (B={self.batch_size}, T), "
                             "(B, T) and (T, T).")
        if self._fed is not None:  # a forward nobody kept anything of
            self.keep(torch.zeros(b, t, dtype=torch.bool))
        reps = 2 if self.guided else 1
        w, last = self.grid_width, self.grid_height * self.grid_width - 1
        if self._pending is not None:
            self._apply_pending()
        n_tok = t + self._row_ends_needed(ancestors)
        codes = codes.to(dev).repeat(reps, 1)
        slots = slots.to(dev).repeat(reps, 1).clamp(max=last)
        ends_row = (slots >= 0) & (slots % w == w - 1)
        if p.row_end_id is None:
            ends_row = torch.zeros_like(ends_row)
        end_tok = (1 + ends_row.long()).cumsum(1)  # exclusive end of each node's tokens
        torch._assert_async((end_tok[:, -1] <= n_tok).all(),
                            "HFSession.forward: node slots do not continue the cached prefix "
                            "(slot = first uncached slot + depth in the tree)")

        rows = self._rows
        start_tok = end_tok - 1 - ends_row.long()
        node_idx = torch.arange(t, device=dev).expand(rows, t)
        node_of = torch.full((rows, n_tok + 1), -1, dtype=torch.long, device=dev)
        node_of.scatter_(1, start_tok, node_idx)
        end_at = torch.where(ends_row, start_tok + 1, torch.full_like(start_tok, n_tok))
        node_of.scatter_(1, end_at, node_idx)
        is_end = torch.zeros(rows, n_tok + 1, dtype=torch.bool, device=dev)
        is_end.scatter_(1, end_at, True)
        node_of, is_end = node_of[:, :n_tok], is_end[:, :n_tok]
        real = node_of >= 0
        gather_node = node_of.clamp(min=0)

        node_emb = p.embed_codes(codes.clamp(min=0)).to(dev, p.dtype)
        node_emb = torch.where((slots < 0)[..., None], self._start[:, None, :], node_emb)
        x = node_emb.gather(1, gather_node[..., None].expand(-1, -1, node_emb.shape[-1]))
        if p.row_end_id is not None:
            end_emb = p.embed_tokens(torch.tensor([p.row_end_id], device=dev)).to(dev, p.dtype)
            x = torch.where(is_end[..., None], end_emb, x)
        node_pos = self._base[:, None] + p.slot_offsets(slots, w, p.row_end_id is not None)
        positions = node_pos.gather(1, gather_node) + is_end.long()

        past = _additive(self._valid, p.dtype)[:, None, None, :].expand(-1, 1, n_tok, -1)
        mask = torch.cat([past, tree_token_mask(ancestors.to(dev, torch.bool), node_of, real, p.dtype)], dim=-1)
        if mark is not None:
            mark()
        hidden = self._run(x, mask, positions)
        out_tok = (end_tok - 1).to(hidden.device)
        hidden = hidden.gather(1, out_tok[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = p.code_logits(hidden).float().to(dev)  # the head may sit on another device
        if mark is not None:
            mark()
        self._fed = (node_of, real)
        self._valid = torch.cat([self._valid, torch.zeros_like(real)], dim=1)  # valid once kept
        if self.guided:
            return logits[:b], logits[b:]
        return logits, None

    # ----------------------------------------------------------------------------- keep
    @torch.no_grad()
    def keep(self, mask: torch.Tensor) -> None:
        """Keep the entries of the fed nodes where ``mask`` (B, T) is True, per row; drop the rest.

        A kept node keeps all its tokens (code and row end). Kept entries move to the front of the
        last forward's region in their fed order; the region is cropped to the longest row at the
        next forward. Reads nothing back from the device (the counts travel asynchronously).
        """
        if self._fed is None:
            raise RuntimeError("keep() called without a forward() before it.")
        node_of, real = self._fed
        self._fed = None
        dev = node_of.device
        reps = 2 if self.guided else 1
        mask = mask.to(dev, torch.bool).repeat(reps, 1)
        if mask.shape[0] != node_of.shape[0]:
            raise ValueError(f"keep got a mask of shape {tuple(mask.shape)}; expected (B={self.batch_size}, T).")
        keep_tok = mask.gather(1, node_of.clamp(min=0)) & real
        n_tok = keep_tok.shape[1]
        base = self._valid.shape[1] - n_tok
        order = torch.sort((~keep_tok).to(torch.int8), dim=1, stable=True).indices
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            idx = order.to(layer.keys.device)[:, None, :, None]
            idx = idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            for name in ("keys", "values"):
                full = getattr(layer, name)
                region = full[..., base:, :]
                region.copy_(region.gather(2, idx))
        kept = keep_tok.sum(1)
        self._valid = torch.cat(
            [self._valid[:, :base], torch.arange(n_tok, device=dev)[None, :] < kept[:, None]], dim=1)
        self._base_len = base
        counts = torch.cat([kept, self._valid.sum(1), mask[:self.batch_size].sum(1)])
        self._pending = _to_host_async(counts)

    @torch.no_grad()
    def retain(self, rows) -> None:
        """Go on with only these batch rows (and their unconditional rows)."""
        if self._pending is not None:
            self._apply_pending()
        keep = list(rows) + ([r + self.batch_size for r in rows] if self.guided else [])
        index = torch.tensor(keep, device=self.parts.device)
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
                layer.values = layer.values.index_select(0, index.to(layer.values.device))
        self._valid, self._start, self._base = self._valid[index], self._start[index], self._base[index]
        self._cached_nodes = self._cached_nodes[list(rows)]
        self.batch_size, self._rows = len(rows), len(keep)
