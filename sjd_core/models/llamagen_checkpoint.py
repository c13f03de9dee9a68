"""LlamaGen checkpoints: safe reading, conversion onto stock transformers classes, and to safetensors.

LlamaGen ships its GPT and its VQ-16 tokenizer as ``.pt`` pickles (a dict with ``"model"``, or a bare
state dict) and no config. This module:

- reads them with ``torch.load(weights_only=True)`` only (plus ``argparse.Namespace``, a plain
  attribute bag LlamaGen's training script stores next to the weights); a pickle that holds code
  or other objects is refused;
- infers the architecture from the tensor shapes (heads from the published GPT sizes, or
  ``llamagen.json``);
- maps the GPT onto ``LlamaForCausalLM``: the fused ``wqkv`` is split, query/key rows are permuted
  from LlamaGen's interleaved rotation pairs to the rotate-half layout, and the rotary module is
  swapped for :class:`~sjd_core.models.llamagen_modules.LlamaGenRotary`; both formats are loaded
  tensor by tensor by the shared ``load_transformers_model`` (``device_map`` included);
- maps the VQ-16 onto transformers' ``JanusVQVAE`` (the same network) by renaming keys;
- converts a ``.pt`` pair once to ``model.safetensors`` + ``vq.safetensors`` + ``llamagen.json``
  (``python -m sjd_core.models.llamagen_checkpoint GPT.pt VQ.pt OUT_DIR``), which then loads
  without any pickle and memory-mapped.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import JanusVQVAE, JanusVQVAEConfig, LlamaConfig

from ..command_line import ArgumentParser, run_command
from ..files import json_field, present_regular_file, read_text, require_regular_file
from ..messages import first_line, quote, unpickling_problem
from .family_common import read_json
from .llamagen_modules import LlamaGenTransformer
from .weights import DeviceMap, load_transformers_model

PROG = "python -m sjd_core.models.llamagen_checkpoint"
SIDECAR = "llamagen.json"
GPT_SAFETENSORS = "model.safetensors"
VQ_SAFETENSORS = "vq.safetensors"
CLASS_NAMES_FILE = "imagenet_classes.txt"  # optional: line i names class i (comma-separated synonyms)
# heads of the published GPT sizes (B, L, XL, XXL, XXXL, 1B, 3B, 7B), keyed by model width
HEADS_BY_DIM = {768: 12, 1024: 16, 1280: 20, 1536: 24, 2560: 40, 2048: 32, 3200: 32, 4096: 32}
CAPTION_TOKENS = 120  # FLAN-T5 feature length of the text-conditional models


@dataclass(frozen=True)
class LlamaGenSpec:
    """The architecture of one LlamaGen GPT checkpoint, inferred from its tensors."""

    kind: str  # "c2i" (class-conditional) or "t2i" (text-conditional)
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    intermediate: int
    vocab_size: int
    cond_tokens: int  # 1 class token, or 120 caption tokens
    num_classes: int = 0
    caption_dim: int = 0
    image_size: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


def read_settings(folder: Path) -> dict:
    """``llamagen.json`` of ``folder`` ({} when there is none), its numbers checked."""
    file = folder / SIDECAR
    settings, source = read_json(file), f"file {quote(str(file))}"
    for name in ("image_size", "n_head"):
        json_field(settings, name, source, "int", minimum=1, default=None)
    return settings


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a LlamaGen ``.pt`` (weights-only pickle) or ``.safetensors`` file."""
    path = require_regular_file(path, "LlamaGen weights file")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise ValueError(f"LlamaGen weights file {quote(str(path))} is not a readable safetensors file "
                             f"(truncated or damaged?): {error}") from None
    if path.stat().st_size == 0:
        raise ValueError(f"LlamaGen weights file {quote(str(path))} is empty (0 bytes): the download did "
                         "not complete; download it again.")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            loaded = torch.load(path, map_location="cpu", weights_only=True,
                                mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        refused_code, reason = unpickling_problem(error)
        if not refused_code:
            raise ValueError(f"LlamaGen weights file {quote(str(path))} cannot be read as a PyTorch "
                             f"checkpoint ({reason}): it is truncated or damaged; download it "
                             "again.") from None
        raise ValueError(
            f"LlamaGen weights file {quote(str(path))} holds Python objects other than tensors (code or "
            f"custom classes); it is refused because only weights-only pickles are read. Use the "
            f"official file, or re-save just its state dict from a trusted environment. ({reason})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, TypeError) as error:
        # random bytes make the unpickler fail in many ways; all of them mean a damaged file
        raise ValueError(f"LlamaGen weights file {quote(str(path))} cannot be read as a PyTorch checkpoint "
                         f"({first_line(error)}): it is truncated or damaged; download it again."
                         ) from None
    state = loaded
    if isinstance(loaded, dict):
        for key in ("model", "module", "state_dict"):
            if isinstance(loaded.get(key), dict):
                state = loaded[key]
                break
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"LlamaGen weights file {quote(str(path))} holds no state dict: expected a dict of "
                         f"tensors, or one under 'model', 'module' or 'state_dict'.")
    return state


def image_size_from_name(name: str) -> int | None:
    """The trained image size in a LlamaGen file name such as ``c2i_L_384.pt`` (None if absent)."""
    match = re.search(r"_(\d+)(?:\.pt|\.safetensors)?$", Path(name).stem + Path(name).suffix)
    return int(match.group(1)) if match else None


def shapes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a state dict (what :func:`infer_spec` reads)."""
    return {key: tuple(value.shape) for key, value in state.items()}


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a safetensors file, read from its header only."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


def infer_spec(shapes: dict[str, tuple[int, ...]], image_size: int, n_head: int | None = None,
               source: str = "checkpoint") -> LlamaGenSpec:
    """Architecture of a LlamaGen GPT from its tensor shapes; ``n_head`` overrides the size table."""
    required = ("tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention.wqkv.weight",
                "layers.0.feed_forward.w1.weight")
    missing = [key for key in required if key not in shapes]
    if missing:
        raise ValueError(f"{source} is not a LlamaGen GPT checkpoint: tensors {missing} are missing "
                         f"(is this the VQ tokenizer file?).")
    vocab_size, dim = shapes["tok_embeddings.weight"]
    n_layer = len({k.split(".")[1] for k in shapes if k.startswith("layers.")})
    if n_head is None:
        if dim in HEADS_BY_DIM:
            n_head = HEADS_BY_DIM[dim]
        elif dim % 64 == 0:
            n_head = dim // 64  # every published size but 3B and 7B uses 64-wide heads
        else:
            raise ValueError(f"{source}: width {dim} is not a published LlamaGen size "
                             f"{sorted(HEADS_BY_DIM)}; give n_head in {SIDECAR} next to it.")
    if dim % n_head:
        raise ValueError(f"n_head={n_head} does not divide the model width {dim} of {source}.")
    head_dim = dim // n_head
    n_kv_head = (shapes["layers.0.attention.wqkv.weight"][0] - dim) // (2 * head_dim)
    intermediate = shapes["layers.0.feed_forward.w1.weight"][0]
    common = dict(dim=dim, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                  intermediate=intermediate, vocab_size=vocab_size, image_size=image_size)
    if "cls_embedding.embedding_table.weight" in shapes:
        return LlamaGenSpec("c2i", cond_tokens=1,
                            num_classes=shapes["cls_embedding.embedding_table.weight"][0] - 1, **common)
    if "cls_embedding.cap_proj.fc1.weight" in shapes:
        tokens = shapes.get("cls_embedding.uncond_embedding", (CAPTION_TOKENS,))[0]
        return LlamaGenSpec("t2i", cond_tokens=tokens,
                            caption_dim=shapes["cls_embedding.cap_proj.fc1.weight"][1], **common)
    raise ValueError(f"{source} has neither a class embedding nor a caption projection; it is not a "
                     f"LlamaGen c2i or t2i GPT checkpoint.")


def _interleaved_to_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Permute projection rows per head from pairs (2j, 2j+1) to pairs (j, j + head_dim/2)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


_GPT_RENAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight",
                "cls_embedding.embedding_table.weight": "cond_embedder.embedding_table.weight",
                "cls_embedding.cap_proj.fc1.weight": "cond_embedder.fc1.weight",
                "cls_embedding.cap_proj.fc2.weight": "cond_embedder.fc2.weight",
                "cls_embedding.uncond_embedding": "cond_embedder.uncond_embedding"}
_LAYER_RENAMES = {"attention.wo.weight": "self_attn.o_proj.weight",
                  "feed_forward.w1.weight": "mlp.gate_proj.weight",
                  "feed_forward.w3.weight": "mlp.up_proj.weight",
                  "feed_forward.w2.weight": "mlp.down_proj.weight",
                  "attention_norm.weight": "input_layernorm.weight",
                  "ffn_norm.weight": "post_attention_layernorm.weight"}


def tensor_converter(spec: LlamaGenSpec) -> Callable[[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]:
    """(LlamaGen name, tensor) -> (``LlamaGenTransformer`` name, tensor) pairs, one tensor at a time.

    The fused ``wqkv`` becomes q/k/v projections with q and k rows in rotate-half order. Unknown
    names pass through unchanged, so the loader reports them.
    """
    kv = spec.n_kv_head * spec.head_dim

    def convert(key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if key in _GPT_RENAMES:
            yield _GPT_RENAMES[key], tensor
            return
        match = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if match is None:
            yield key, tensor
            return
        prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
        if rest == "attention.wqkv.weight":
            q, k, v = tensor.split([spec.dim, kv, kv])
            yield prefix + "self_attn.q_proj.weight", _interleaved_to_half(q, spec.n_head)
            yield prefix + "self_attn.k_proj.weight", _interleaved_to_half(k, spec.n_kv_head)
            yield prefix + "self_attn.v_proj.weight", v
        else:
            yield prefix + _LAYER_RENAMES.get(rest, rest), tensor

    return convert


def llama_config(spec: LlamaGenSpec, grid_size: int) -> LlamaConfig:
    """The config of a :class:`LlamaGenTransformer` running this LlamaGen GPT."""
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.dim, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
        num_key_value_heads=spec.n_kv_head, head_dim=spec.head_dim, rms_norm_eps=spec.norm_eps,
        max_position_embeddings=spec.cond_tokens + grid_size * grid_size, attention_bias=False,
        mlp_bias=False, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, attn_implementation="sdpa")
    config.llamagen = {"kind": spec.kind, "grid_size": grid_size, "cond_tokens": spec.cond_tokens,
                       "num_classes": spec.num_classes, "caption_dim": spec.caption_dim,
                       "rope_base": spec.rope_base}
    return config


def build_gpt(tensors: Iterable[tuple[str, torch.Tensor]] | list[Path], spec: LlamaGenSpec,
              grid_size: int, device: torch.device, dtype: torch.dtype,
              device_map: DeviceMap = None, quantization=None) -> LlamaGenTransformer:
    """A ready :class:`LlamaGenTransformer` from LlamaGen tensors (a ``.pt`` state dict's items or
    safetensors files), filled one tensor at a time by the shared loader."""
    return load_transformers_model(LlamaGenTransformer, llama_config(spec, grid_size), tensors, device,
                                   dtype, device_map, convert=tensor_converter(spec), quantization=quantization)


_VQ_RENAMES = [
    (r"^(encoder|decoder)\.mid\.0\.", r"\1.mid.block_1."),
    (r"^(encoder|decoder)\.mid\.1\.", r"\1.mid.attn_1."),
    (r"^(encoder|decoder)\.mid\.2\.", r"\1.mid.block_2."),
    (r"^encoder\.conv_blocks\.(\d+)\.res\.", r"encoder.down.\1.block."),
    (r"^encoder\.conv_blocks\.(\d+)\.", r"encoder.down.\1."),
    (r"^decoder\.conv_blocks\.(\d+)\.res\.", r"decoder.up.\1.block."),
    (r"^decoder\.conv_blocks\.(\d+)\.", r"decoder.up.\1."),
]


def vq_to_janus(state: dict[str, torch.Tensor], source: str = "VQ checkpoint",
                ) -> tuple[JanusVQVAEConfig, dict[str, torch.Tensor]]:
    """LlamaGen VQ tensors -> (``JanusVQVAEConfig``, ``JanusVQVAE`` state dict) by renaming keys.

    The config's ``num_patches`` (the code grid side the decoder reshapes to) is left for the
    caller to set from the image size (:func:`vq_downsample`).
    """
    needed = ("encoder.conv_in.weight", "quantize.embedding.weight", "quant_conv.weight",
              "decoder.conv_out.weight")
    missing = [key for key in needed if key not in state]
    if missing:
        raise ValueError(f"{source} is not a LlamaGen VQ tokenizer: tensors {missing} are missing "
                         f"(is this the GPT file?).")
    base = state["encoder.conv_in.weight"].shape[0]
    levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.conv_blocks.")})
    multipliers = [state[f"encoder.conv_blocks.{i}.res.0.conv1.weight"].shape[0] // base for i in levels]
    res_blocks = len({k.split(".")[4] for k in state if k.startswith("encoder.conv_blocks.0.res.")})
    codes, code_dim = state["quantize.embedding.weight"].shape
    config = JanusVQVAEConfig(
        embed_dim=code_dim, num_embeddings=codes, latent_channels=state["quant_conv.weight"].shape[1],
        base_channels=base, channel_multiplier=multipliers, num_res_blocks=res_blocks,
        num_patches=1, out_channels=state["decoder.conv_out.weight"].shape[0])
    renamed: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "quantize.codebook_used":
            continue
        for pattern, replacement in _VQ_RENAMES:
            key, hits = re.subn(pattern, replacement, key)
            if hits:
                break
        renamed[key] = value
    return config, renamed


def vq_downsample(config: JanusVQVAEConfig) -> int:
    """Pixels per code side of a VQ (16 for LlamaGen's VQ-16)."""
    return 2 ** (len(config.channel_multiplier) - 1)


def build_vq(config: JanusVQVAEConfig, renamed: dict[str, torch.Tensor], device: torch.device,
             dtype: torch.dtype) -> JanusVQVAE:
    """A ready ``JanusVQVAE`` holding LlamaGen's VQ-16 weights (from :func:`vq_to_janus`)."""
    return load_transformers_model(JanusVQVAE, config, list(renamed.items()), device, dtype)


def convert_to_safetensors(gpt: str | Path, vq: str | Path, out_dir: str | Path,
                           image_size: int | None = None, n_head: int | None = None) -> Path:
    """One-time conversion of a LlamaGen ``.pt`` pair to safetensors + ``llamagen.json``.

    ``image_size`` and ``n_head`` default to the ``llamagen.json`` beside the GPT, then to the
    file name and the published sizes.
    The tensors keep LlamaGen's names (the loader maps them on load, one code path for both
    formats); ``imagenet_classes.txt`` beside the GPT is copied along. Returns the output folder,
    loadable by ``load_model``.
    """
    gpt, vq, out_dir = Path(gpt), Path(vq), Path(out_dir)
    settings = read_settings(gpt.parent)
    size = image_size or settings.get("image_size") or image_size_from_name(gpt.name)
    n_head = n_head or settings.get("n_head")
    if size is None:
        raise ValueError(f"The image size of {quote(gpt.name)} is not in its name (such as c2i_L_384.pt); "
                         f"pass image_size (256, 384 or 512, the size it was trained at).")
    gpt_state = read_state_dict(gpt)
    spec = infer_spec(shapes_of(gpt_state), size, n_head, source=str(gpt))
    vq_state = read_state_dict(vq)
    vq_to_janus(vq_state, source=str(vq))  # validates before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in gpt_state.items()}, str(out_dir / GPT_SAFETENSORS))
    save_file({k: v.contiguous() for k, v in vq_state.items()}, str(out_dir / VQ_SAFETENSORS))
    names = gpt.parent / CLASS_NAMES_FILE
    if present_regular_file(names, "class names file"):
        (out_dir / CLASS_NAMES_FILE).write_text(read_text(names, what="class names file"),
                                                encoding="utf-8")
    (out_dir / SIDECAR).write_text(json.dumps(
        {"kind": spec.kind, "image_size": size, "n_head": spec.n_head}, indent=2) + "\n")
    return out_dir


def _main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(
        prog=PROG,
        description="Convert a LlamaGen GPT .pt and its VQ .pt to safetensors (weights-only read).")
    parser.add_argument("gpt", help="GPT checkpoint, e.g. c2i_L_384.pt")
    parser.add_argument("vq", help="VQ tokenizer checkpoint, e.g. vq_ds16_c2i.pt")
    parser.add_argument("out_dir", help="folder to write model.safetensors, vq.safetensors, llamagen.json")
    parser.add_argument("--image-size", type=int, default=None,
                        help="trained image size when the GPT file name does not end in it")
    parser.add_argument("--n-head", type=int, default=None,
                        help="attention heads, for widths that are not a published LlamaGen size")
    args = parser.parse_args(argv)
    print(run_command(PROG, lambda: convert_to_safetensors(args.gpt, args.vq, args.out_dir,
                                                           args.image_size, args.n_head)))


if __name__ == "__main__":
    _main()

__all__ = ["LlamaGenSpec", "read_settings", "read_state_dict", "image_size_from_name", "shapes_of",
           "safetensors_shapes", "infer_spec", "tensor_converter", "llama_config", "build_gpt", "vq_to_janus", "vq_downsample", "build_vq", "convert_to_safetensors"]
