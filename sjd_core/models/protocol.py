"""The seam between the decoding core and a model family.

The engine sees a model only through :class:`ImageTokenModel` and the :class:`DecodingSession`
it starts. Everything family-specific (prompt templates, structural tokens such as row ends,
classifier-free-guidance contexts, vocabulary offsets, the VQ decoder) lives behind it; the core
does distributions, drafts, verification and bookkeeping.

Slots and fed nodes
-------------------
An image is a grid of ``height x width`` code slots in raster order. Each engine iteration feeds
a small set of *nodes* per batch row: node ``i`` holds a code (``codes[b, i]``) placed at slot
``slots[b, i]``. Slot ``-1`` is the token just before the first code (the model's own
begin-of-image token, or whatever its layout puts there): the adapter substitutes that token and
ignores ``codes`` for it. The output for a node is the model's logits over the image codebook for
the slot *after* the node's slot, given the committed prefix and the node's ancestors.

Node 0 of every forward is the last committed slot's node, and a node's slot is always that
slot plus the node's depth in the tree (sessions may rely on this to size structural tokens).

``ancestors[i, j]`` is True when node ``i`` may attend to fed node ``j`` (its ancestors and itself);
it is a host (numpy) array, so that sessions need not read it back from the device (a tensor is
accepted too and read once per distinct tree);
every node also sees the whole cached prefix. A plain window is a chain (lower triangular); a draft
tree of proactive drafting is a real tree. The adapter inserts structural tokens (row ends, ...)
after the code nodes whose slot ends a row, and returns the output of the last token it fed for
each node, so the engine never sees them.

After verification the engine calls ``keep(mask)``: the cache keeps the entries of the fed nodes
where ``mask`` is True (per row; rows may keep different counts) and drops the rest of that
forward, so the next forward continues from the committed prefix. A forward may also be probed
and thrown away: ``keep`` with an all-False mask leaves the cache as it was before that forward.

Capacity: ``GenerationRequest.max_nodes`` is the most nodes the engine will feed in one forward;
a session may size its caches once, for the prompt, the whole image and that many nodes.

Recipes: official sources often disagree on sampling settings (a sample script, an evaluation
script, a demo). ``recipes`` maps a name to each official :class:`SamplingDefaults`, the
default first, each naming its source; ``defaults`` is that first recipe.

Batches shrink: when some images are finished the engine calls ``retain(rows)`` with the batch
rows that are still decoding; from then on ``batch_size`` is ``len(rows)`` and row ``i`` of every
tensor means old row ``rows[i]``.

Compiling: with the ``compile`` setting on, the engine calls the session's ``compile_network()``
before the first forward; the session then runs its network compiled, and the object it returns
tells the trace how that went (``report()``: shapes compiled, shapes run uncompiled, a failure)
and counts the calls that compiled (``compilations``: ``auto`` does not time those iterations).

Warnings: a session may carry ``warnings``, a list of sentences about how the request was read;
the engine copies them into the trace, and the run's summary shows them. A session whose images
are drawn without any prompt (an empty prompt where the family documents that as unconditional)
sets ``unconditional = True``, and the summary says so. A non-empty prompt that the family reads
as nothing is refused by ``start`` before any work, never drawn unconditionally.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingDefaults:
    """One official sampling recipe of a family, used when the user does not override it.

    ``source`` names where the numbers come from (a script, demo or document of the official
    release), so users can tell two official recipes apart. ``guidance_schedule`` names how the
    official sampler varies the guidance scale along the image (``constant``: not at all; the
    names are those of the decoding core's ``SamplingSettings.guidance_schedule``).
    """

    guidance: float
    temperature: float
    top_k: int  # 0 = no top-k
    top_p: float = 1.0
    source: str = ""
    guidance_schedule: str = "constant"


@dataclass(frozen=True)
class MemoryShape:
    """What sizes a decoding session's memory, for the engine's batch check before any work.

    A model may carry one as ``memory_shape`` (weights are not counted: they are loaded already).
    ``dtype_bytes``: bytes per value of the cache and the activations.
    """

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    dtype_bytes: int

    @classmethod
    def of_config(cls, config: object, dtype: torch.dtype) -> "MemoryShape":
        """From a transformers config (its text config where it has one, as Janus does)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        hidden = int(text.hidden_size)
        return cls(layers=int(text.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(text, "head_dim", None) or hidden // heads), hidden=hidden,
                   intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
                   dtype_bytes=dtype.itemsize)

    def cache_bytes(self, positions: int) -> int:
        """Bytes of keys and values for ``positions`` cached positions (of one sequence, or
        summed over several)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes * positions


@dataclass(frozen=True)
class GenerationRequest:
    """What to draw: one prompt (or class name) per batch row, or one prompt for all rows."""

    prompt: str
    negative_prompt: str = ""
    resolution: tuple[int, int] | None = None  # (width, height) in pixels; None = family default
    batch_size: int = 1
    guidance: float = 1.0  # 1.0 means no unconditional context is needed
    extra: dict = field(default_factory=dict)  # family-specific options (documented per adapter)
    max_nodes: int = 64  # the most nodes one forward will feed (set by the engine)


@runtime_checkable
class DecodingSession(Protocol):
    """A prefilled KV cache for ``batch_size`` images (and their unconditional contexts)."""

    batch_size: int
    grid_height: int
    grid_width: int
    guided: bool  # True when forward returns unconditional logits too

    def forward(
        self, codes: torch.Tensor, slots: torch.Tensor, ancestors: np.ndarray | torch.Tensor,
        committed: Sequence[int], mark: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``codes`` (B, T) at ``slots`` (B, T) with the (T, T) ``ancestors`` mask.

        ``committed`` (host integers, one per row) is how many slots each row has committed
        before this forward, so node 0 sits at slot ``committed[b] - 1``; it lets the session
        size its inputs without reading anything back from the device.
        Returns conditional and unconditional (or None) logits, each (B, T, codebook_size),
        in float32. ``mark``, when given, is called right before the network runs and right
        after its logits are computed (without synchronising the device), so that the caller can
        time the network apart from the session's own input building.
        """
        ...

    def keep(self, mask: torch.Tensor, run: Callable | None = None) -> None:
        """Keep the cache entries of the fed nodes where ``mask`` (B, T) is True; drop the rest.
        ``run(function, *arguments)``, when given, calls the session's device work for it (the
        engine passes its stage runner, which compiles that work per tree shape)."""
        ...

    def advance(self, codes: torch.Tensor, committed: Sequence[int],
                mark: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Plain autoregression's step: ``forward`` of one node per row, ``codes`` (B,) at slot
        ``committed[b] - 1``, then ``keep`` of it; conditional and unconditional (or None) logits
        (B, codebook_size). A session may take it with less bookkeeping than the pair."""
        ...

    def retain(self, rows: Sequence[int]) -> None:
        """Go on with only these batch rows (increasing indices into the current rows)."""
        ...

    def compile_network(self) -> object:
        """Run the network of later forwards compiled; an object whose ``report()`` is a dict for
        the trace and whose ``compilations`` counts the calls that compiled (see the module
        docstring)."""
        ...


@runtime_checkable
class ImageTokenModel(Protocol):
    """A loaded model family, ready to start decoding sessions and to decode code grids."""

    family: str
    codebook_size: int
    device: torch.device
    recipes: Mapping[str, SamplingDefaults]  # name -> official recipe, the default first
    defaults: SamplingDefaults  # the first of ``recipes``
    # optional: ``memory_shape: MemoryShape``, so that the engine counts the KV cache and the
    # network's activations when it checks a batch (without it, only the engine's own tensors)

    def supported_resolutions(self) -> list[tuple[int, int]]:
        """(width, height) pairs in pixels this model can draw; the first is the default."""
        ...

    def grid_for(self, resolution: tuple[int, int] | None) -> tuple[int, int]:
        """(grid_height, grid_width) of code slots for a resolution; ValueError if unsupported."""
        ...

    def codebook_embeddings(self) -> torch.Tensor:
        """(codebook_size, dim) float embeddings of the VQ codes, for relaxed acceptance."""
        ...

    def start(self, request: GenerationRequest) -> DecodingSession:
        """Tokenise and prefill; the returned session is positioned before the first code."""
        ...

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, H, W) codes -> (B, height_px, width_px, 3) float images in [0, 1], channels-last."""
        ...
