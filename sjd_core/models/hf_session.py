"""One decoding session over any transformers decoder, shared by every model family.

A family adapter describes itself with :class:`DecoderParts` (how a code becomes an input
embedding, how hidden states become codebook logits, its row-end token) and the prefill
:class:`Context` of each conditional and unconditional row; :class:`HFSession` runs them through
the shared :class:`~sjd_core.models.session.slot_session.SlotSession` (token layout, preallocated
key/value cache, persistent attention mask, keep, retain):

* every forward passes the backbone explicit ``position_ids`` and a 4D additive float mask
  (0 = attend, ``finfo(dtype).min`` = blocked), which transformers hands to the attention as it
  is, and a :class:`~transformers.Cache` whose layers write into the session's preallocated
  buffers and attend over all of them (the mask blocks what a row does not hold);
* the structural tokens (row ends) are inserted after the code nodes whose slot ends a grid row;
  a node's output is read at the last token fed for it, so the output of a code that ends a row
  is the model's prediction after the row-end token: the next row's first code.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import Cache

from .session.kv_store import KVStore
from .session.slot_session import Fed, SlotSession
from ..transfer import to_device

__all__ = ["Context", "DecoderParts", "HFSession"]


@dataclass(frozen=True)
class Context:
    """One row's prefill: token ids (1-D) or input embeddings ((n, dim)); n >= 1.

    Its last element is the slot -1 token: the engine feeds it, the prefill runs the rest.
    ``position`` is the sequence position of that token; by default ``n - 1`` (positions count
    from 0 without gaps). LlamaGen's captions, fed without their masked padding, set it to where
    the padded sequence puts it.
    """

    ids: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    position: int | None = None

    def __post_init__(self) -> None:
        if (self.ids is None) == (self.embeds is None):
            raise ValueError("Context needs exactly one of ids or embeds.")
        if len(self) < 1:
            raise ValueError("Context must hold at least the slot -1 token (got an empty one).")
        if self.position is not None and self.position < len(self) - 1:
            raise ValueError(f"Context position={self.position} is not allowed: the slot -1 token "
                             f"comes after the other {len(self) - 1} context tokens.")

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else self.embeds.shape[0]

    @property
    def start(self) -> int:
        """Sequence position of the slot -1 token."""
        return len(self) - 1 if self.position is None else self.position


@dataclass
class DecoderParts:
    """The family-specific pieces of a transformers decoder.

    backbone: module called as ``backbone(inputs_embeds=, attention_mask=, position_ids=, cache=,
        use_cache=True)`` (``past_key_values=`` where its forward takes that instead) returning
        an object with ``last_hidden_state`` (a ``LlamaModel``, ``ChameleonModel``, Janus's
        ``language_model``...). It must use ``sdpa`` or ``eager`` attention (flash attention
        cannot express tree masks).
    embed_tokens: token ids (any shape) -> input embeddings (shape + (dim,)).
    embed_codes: image codes (R, T) -> input embeddings (R, T, dim); an id offset or a separate
        image embedding path.
    code_logits: hidden states (R, T, hidden) -> logits (R, T, codebook_size) over the codebook.
    row_end_id: the token fed after the last code of every grid row, or None.
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


class StoreCache(Cache):
    """transformers' view of a :class:`KVStore`: each attention layer writes its new keys and
    values into the store in place and attends to views of it.

    It has no transformers cache layers: the models here use a cache only through ``update``
    (and ``get_seq_length`` when no positions are given, which the session always gives: there
    it is the columns every layer attends over, the whole capacity).
    """

    def __init__(self, store: KVStore) -> None:
        super().__init__(layers=[])
        self.store = store

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.update(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.capacity


def cache_keyword(backbone: nn.Module) -> str:
    """The keyword ``backbone``'s forward takes the cache by: ``past_key_values`` where it names
    that and not ``cache`` (transformers 5 releases before the rename; there ``cache`` would be
    swallowed by ``**kwargs``, and the layers would attend to the fed tokens alone), else
    ``cache`` (a forward that passes ``**kwargs`` on is taken to be a newer one)."""
    parameters = inspect.signature(backbone.forward).parameters
    return "past_key_values" if "past_key_values" in parameters and "cache" not in parameters \
        else "cache"


class HFSession(SlotSession):
    """A prefilled cache for ``B`` images (and their unconditional rows) on a transformers decoder.

    ``max_nodes`` is the most nodes one forward feeds (``GenerationRequest.max_nodes``): the
    cache and the mask are sized once for the longest context, the whole image and that many
    nodes (and their row ends).
    """

    def __init__(self, parts: DecoderParts, cond: list[Context], uncond: list[Context] | None,
                 grid: tuple[int, int], max_nodes: int = 64) -> None:
        if uncond is not None and len(uncond) != len(cond):
            raise ValueError(f"uncond has {len(uncond)} contexts, cond has {len(cond)}: need one per image.")
        self.parts = parts
        contexts = list(cond) + (list(uncond) if uncond is not None else [])
        super().__init__(batch_size=len(cond), guided=uncond is not None, grid=grid,
                         row_end=parts.row_end_id is not None,
                         prefix=[len(c) - 1 for c in contexts], start=[c.start for c in contexts],
                         max_nodes=max_nodes, device=parts.device, mask_dtype=parts.dtype)
        self._cache = StoreCache(self.store)
        self._cache_keyword = cache_keyword(parts.backbone)
        with torch.no_grad():
            embeds = [self._embed(c) for c in contexts]
            self._start = torch.stack([e[-1] for e in embeds])  # (R, dim) slot -1 inputs
            self._row_end = None
            if parts.row_end_id is not None:
                ids = torch.tensor([parts.row_end_id], device=parts.device)
                self._row_end = parts.embed_tokens(ids).to(parts.device, parts.dtype)[0]
            longest = max(len(c) for c in contexts) - 1
            padded = self._start.new_zeros(len(contexts), longest, self._start.shape[-1])
            for row, e in enumerate(embeds):  # once per context, not per slot
                padded[row, self.context_columns(row, len(e) - 1)] = e[:-1]
            self._prefill(padded)

    def _embed(self, ctx: Context) -> torch.Tensor:
        if ctx.embeds is not None:
            return ctx.embeds.to(self.parts.device, self.parts.dtype)
        return self.parts.embed_tokens(ctx.ids.to(self.parts.device)).to(self.parts.dtype)

    def _inputs(self, codes: torch.Tensor, fed: Fed | None) -> torch.Tensor:
        x = to_device(self.parts.embed_codes(codes), self.device, self.parts.dtype)
        if self.guided:
            x = torch.cat([x, x])
        if fed is None:
            return x
        starting, token_node = fed.part("starting"), fed.part("token_node")
        if starting is not None:
            x[:, 0] = torch.where(starting[:, None], self._start, x[:, 0])
        if token_node is not None:
            x = x.gather(1, token_node[..., None].expand(-1, -1, x.shape[-1]))
            x = torch.where(fed.part("row_end")[..., None], self._row_end, x)
        return x

    def _run(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
             ) -> torch.Tensor:
        out = self.parts.backbone(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                                  use_cache=True, **{self._cache_keyword: self._cache})
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.parts.code_logits(hidden)
        return to_device(logits, self.device, torch.float32)  # the head may sit on another device

    def _select_rows(self, index: torch.Tensor) -> None:
        self._start = self._start.index_select(0, index)
