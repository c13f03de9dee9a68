"""Load transformers weights the way users expect; every transformers family uses these rules.

* dtype: bfloat16 on CUDA, float32 on the CPU, unless the caller names one;
* no second copy in memory: the model is built with empty (meta) parameters and each checkpoint
  tensor is cast and assigned in place, one tensor at a time;
* all checkpoint files are checked (present, complete) before anything is loaded, so a bad
  checkpoint fails without leaving a half-loaded model behind;
* ``device_map`` (``"auto"``, ``"balanced"``, or a dict of module name -> device, ``"cpu"`` or
  ``"disk"``) hands placement and offloading to accelerate;
* ``weights="int8"`` or ``"int4"`` stores the weights of the transformer's linear layers in 8 or 4
  bits (weight-only: activations, the KV cache and the arithmetic stay in ``dtype``), with torchao's
  configs carried by transformers' ``TorchAoConfig``. Each layer is quantised on its device right
  after its weight is filled, so the full-precision model never exists in memory. Embeddings, the
  output head and the image decoder keep ``dtype``. Decoding is then exact with respect to the
  quantised model's own distribution, which differs a little from the original's.

Which family a folder holds is decided by :mod:`.registry`.
"""

from __future__ import annotations

import dataclasses
import tempfile
import weakref
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import nn

from ..files import present_regular_file, read_json_object
from ..messages import quote

if TYPE_CHECKING:
    from transformers import TorchAoConfig

__all__ = ["DeviceMap", "resolve_device_dtype", "safetensors_files", "load_transformers_model",
           "input_device", "WEIGHT_FORMATS", "FLOAT_FORMATS", "QUANTIZED_FORMATS", "quantization_config",
           "stored_bytes"]

DeviceMap = str | dict[str, str | int | torch.device] | None
WEIGHT_FORMATS = ("bf16", "fp16", "fp32", "int8", "int4")
QUANTIZED_FORMATS = ("int8", "int4")
FLOAT_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT4_GROUP_SIZES = (128, 64, 32)  # the first that divides a layer's input width is used
ALWAYS_FULL_PRECISION = ("lm_head",)  # as transformers' quantizers keep the output head
QUANTIZATION_EXTRA = "pip install torchao  (the pack's optional extra: sjd-autoregressive[quantization])"


def quantization_config(weights: str | None, device: torch.device,
                        keep: tuple[str, ...] = ()) -> "TorchAoConfig | None":
    """transformers' ``TorchAoConfig`` for int8 or int4 weight-only storage on ``device`` (None for
    the other formats).

    int8: torchao's ``Int8WeightOnlyConfig`` (per-channel scales; CPU and CUDA). int4: groups of
    128 weights share a scale and zero point; ``Int4WeightOnlyConfig`` with the tile-packed
    layout on CUDA (bfloat16), torchao's CPU int4 layout elsewhere. ``keep``: module name fragments
    left in full precision, besides the output head.
    """
    if weights not in QUANTIZED_FORMATS:
        return None  # full-precision formats only set the dtype (resolve_device_dtype)
    try:
        import torchao  # noqa: F401
        from transformers import TorchAoConfig
    except ImportError as error:
        raise ImportError(f"weights={quote(weights)} needs the torchao library, which is not installed: "
                          f"{QUANTIZATION_EXTRA}; or pick bf16, fp16 or fp32.") from error
    if weights == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        quant_type = Int8WeightOnlyConfig()
    elif device.type == "cuda":
        from torchao.quantization import Int4WeightOnlyConfig

        quant_type = Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZES[0],
                                          int4_packing_format="tile_packed_to_4d")
    else:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

        quant_type = PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZES[0])
    return TorchAoConfig(quant_type=quant_type, modules_to_not_convert=list(ALWAYS_FULL_PRECISION + keep))


def _quantize_layer(module: nn.Module, config: "TorchAoConfig") -> None:
    """Quantise one linear layer in place with ``config.quant_type`` (int4: a group size that fits)."""
    from torchao.quantization import quantize_

    quant_type = config.quant_type
    if getattr(quant_type, "group_size", None) is not None:  # int4: groups along the input
        fitting = [g for g in INT4_GROUP_SIZES if module.in_features % g == 0]
        if not fitting:
            return  # no group size divides this layer's width: it keeps the compute dtype
        quant_type = dataclasses.replace(quant_type, group_size=fitting[0])
    quantize_(module, quant_type)


def stored_bytes(module: nn.Module) -> int:
    """Bytes the parameters and buffers of ``module`` occupy, quantised tensors included."""
    def size(t: torch.Tensor) -> int:
        if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, name)) for name in names)
        return t.numel() * t.element_size()

    return sum(size(t) for t in list(module.parameters()) + list(module.buffers()))


def resolve_device_dtype(device: str | torch.device | None, dtype: torch.dtype | None,
                         weights: str | None = None) -> tuple[torch.device, torch.dtype]:
    """Default device (CUDA if present) and dtype (bfloat16 on CUDA, float32 elsewhere).

    weights: one of :data:`WEIGHT_FORMATS` or None; a float format sets the dtype (and must agree
    with ``dtype`` when both are given); int4 on CUDA computes in bfloat16, its kernels' dtype.
    """
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={quote(weights)} is not allowed: use one of {WEIGHT_FORMATS}.")
    if weights in FLOAT_FORMATS:
        if dtype is not None and dtype != FLOAT_FORMATS[weights]:
            raise ValueError(f"weights={quote(weights)} and dtype={dtype} disagree: give one of them.")
        dtype = FLOAT_FORMATS[weights]
    if weights == "int4" and dev.type == "cuda":
        if dtype not in (None, torch.bfloat16):
            raise ValueError(f"weights='int4' on CUDA computes in bfloat16 (torchao's int4 kernels); "
                             f"dtype={dtype} is not allowed with it: leave dtype unset or use int8.")
        dtype = torch.bfloat16
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={quote(dtype)} is not allowed: use a floating torch dtype such as "
                         "torch.bfloat16, torch.float16 or torch.float32.")
    return dev, dtype


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files (via ``model.safetensors.index.json`` when sharded).

    Checks that every file exists and is complete; raises before anything is loaded.
    """
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    if present_regular_file(index, "safetensors index"):
        weight_map = read_json_object(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{quote(str(index))}: 'weight_map' must map tensor names to shard file names, "
                             f"got {quote(weight_map)}; download the index again.")
        files = [_shard(folder, index, name) for name in dict.fromkeys(weight_map.values())]
    elif present_regular_file(folder / "model.safetensors", "weights file"):
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(
            f"No weights in {quote(str(folder))}: expected model.safetensors, or shards listed in "
            "model.safetensors.index.json (config.json alone is not a checkpoint).")
    for f in files:
        if not present_regular_file(f, "weight shard"):
            raise FileNotFoundError(f"Weight shard {quote(f.name)} listed in {index.name} is missing from "
                                    f"{quote(str(folder))}; download it again.")
        try:
            with safe_open(str(f), "pt") as handle:
                handle.keys()
        except SafetensorError as err:
            raise ValueError(f"Weight file {quote(str(f))} is damaged or truncated ({err}); download it again.") from err
    return files


def _shard(folder: Path, index: Path, name: object) -> Path:
    """The file a shard name of ``index`` names, refused unless it stays inside ``folder``.

    The check reads the name, not the file system, so shards that are symlinks (as in the
    Hugging Face cache) still load.
    """
    readings = (PurePosixPath(name), PureWindowsPath(name)) if isinstance(name, str) else ()
    if not name or not readings or any(p.anchor or ".." in p.parts for p in readings):
        raise ValueError(f"{quote(str(index))} names the shard {quote(name)}, which is not a file inside "
                         f"{quote(str(folder))}; shard names must be file names in the checkpoint "
                         "folder. Download the index again.")
    return folder / name


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def _owner(name: str, device_map: dict) -> str | int | torch.device:
    parts = name.split(".")
    for i in range(len(parts), -1, -1):
        prefix = ".".join(parts[:i])
        if prefix in device_map:
            return device_map[prefix]
    raise ValueError(f"device_map does not place parameter {quote(name)}; give every module a device "
                     "(a dict key '' places the whole model).")


def _without_nesting(model: nn.Module, device_map: dict) -> dict:
    """The same placement with no key inside another (accelerate cannot dispatch nested keys).

    A key that has more specific keys below it (``{"": "cpu", "model.layers.1": "disk"}``) is
    replaced by its sub-modules and own tensors, each placed by the most specific key above it.
    """
    flat: dict = {}

    def place(prefix: str, module: nn.Module) -> None:
        inner = [k for k in device_map if k != prefix and (not prefix or k.startswith(prefix + "."))]
        if not inner:
            flat[prefix] = _owner(prefix, device_map) if prefix else device_map[""]
            return
        for name, child in module.named_children():
            place(f"{prefix}.{name}" if prefix else name, child)
        own = [name for name, _ in module.named_parameters(recurse=False)]
        own += [name for name, _ in module.named_buffers(recurse=False)]
        for name in own:
            flat[f"{prefix}.{name}" if prefix else name] = _owner(f"{prefix}.{name}", device_map)

    if "" in device_map or any("." in k for k in device_map):
        place("", model)
        return flat
    return dict(device_map)


def _resolve_device_map(model: nn.Module, device_map: DeviceMap, dtype: torch.dtype) -> dict:
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    if isinstance(device_map, dict):
        return _without_nesting(model, device_map)
    allowed = ("auto", "balanced", "balanced_low_0", "sequential")
    if device_map not in allowed:
        raise ValueError(f"device_map={quote(device_map)} is not allowed: use one of {allowed} or a dict "
                         "of module name -> device ('cuda:0', 'cpu', 'disk').")
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    max_memory = None
    if device_map != "sequential":
        max_memory = get_balanced_memory(model, dtype=dtype, no_split_module_classes=no_split,
                                         low_zero=device_map == "balanced_low_0")
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)


def load_transformers_model(model_class: type, config, files: list[Path] | Iterable[tuple[str, torch.Tensor]],
                            device: torch.device,
                            dtype: torch.dtype, device_map: DeviceMap = None,
                            convert: Callable[[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]] | None = None,
                            keep_float32: tuple[str, ...] = (),
                            prepare: Callable[[nn.Module], None] | None = None,
                            quantization: "TorchAoConfig | None" = None) -> nn.Module:
    """Build ``model_class(config)`` with empty weights and fill it from ``files``, tensor by tensor.

    files: safetensors files, or (name, tensor) pairs already at hand (e.g. a weights-only ``.pt``).

    convert: optional (key, tensor) -> iterable of (key, tensor): renames, reshapes or drops
        checkpoint tensors (e.g. Lumina-mGPT's per-shard q/k norms).
    keep_float32: name fragments of parameters that stay float32 whatever ``dtype`` is.
    prepare: optional change to the empty model before it is filled (e.g. drop a sub-module the
        pack never runs, whose tensors ``convert`` then skips).
    quantization: a ``TorchAoConfig`` from :func:`quantization_config`, or None. Its linear layers
        (except ``modules_to_not_convert``) are quantised as soon as their weight is in place; a
        ``device_map`` may place them on devices but not on ``"disk"``.
    Missing or unexpected tensors raise ``ValueError`` naming them.
    """
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import offload_weight, save_offload_index, set_module_tensor_to_device

    config._attn_implementation = "sdpa"
    with init_empty_weights(include_buffers=False):
        model = model_class(config)
        if prepare is not None:
            prepare(model)
    model.eval()
    placement = None if device_map is None else _resolve_device_map(model, device_map, dtype)
    quantized_layers = _layers_to_quantize(model, quantization)
    if quantized_layers and placement is not None and "disk" in placement.values():
        raise ValueError("int8 / int4 weights cannot be offloaded to disk: place every module on a "
                         "device ('cuda:0', 'cpu') in device_map, or load bf16 / fp16 weights.")
    offload_dir, offload_index = None, {}
    if placement is not None and "disk" in placement.values():
        offload_dir = tempfile.mkdtemp(prefix="sjd-offload-")
        weakref.finalize(model, _remove_tree, offload_dir)  # also when loading fails half-way
    expected = dict(model.named_parameters())
    # persistent buffers (e.g. BatchNorm running statistics in Emu3's VQ) load like parameters
    buffers = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in expected}
    expected.update(buffers)
    seen: set[str] = set()
    unexpected: list[str] = []
    on_disk = isinstance(files, list) and all(isinstance(f, Path) for f in files)
    stream = _tensors(files) if on_disk else iter(files)
    for key, value in stream:
        for name, tensor in (convert(key, value) if convert else ((key, value),)):
            if name not in expected:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(f"Checkpoint tensor {quote(name)} has shape {tuple(tensor.shape)}, the model "
                                 f"expects {tuple(expected[name].shape)}: the config does not match the weights.")
            target = dtype if (tensor.is_floating_point() and not any(k in name for k in keep_float32)) else None
            where = device if placement is None else _owner(name, placement)
            if where == "disk":
                offload_weight(tensor.to(target) if target else tensor, name, offload_dir, offload_index)
            else:
                set_module_tensor_to_device(model, name, where, value=tensor, dtype=target)
                if name in quantized_layers:
                    _quantize_layer(quantized_layers[name], quantization)
            seen.add(name)
    if unexpected:
        raise ValueError(f"The checkpoint holds tensors this model does not have: {sorted(unexpected)[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all); is this the right family?")
    missing = sorted(set(expected) - seen - _tied(model) - set(buffers))
    if missing:
        raise ValueError(f"The checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:8]}; "
                         "the download is incomplete or the config belongs to another model.")
    model.tie_weights()
    if placement is None:
        model.to(device)  # buffers created at build time
    else:
        if offload_dir is not None:
            save_offload_index(offload_index, offload_dir)
        dispatch_model(model, placement, offload_dir=offload_dir)
    return model


def _layers_to_quantize(model: nn.Module, quantization: "TorchAoConfig | None"
                        ) -> dict[str, nn.Linear]:
    """Weight name -> linear layer, for every layer ``quantization`` converts (none without it)."""
    if quantization is None:
        return {}
    keep = tuple(quantization.modules_to_not_convert or ())
    return {f"{name}.weight": module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not any(k in name for k in keep)}


def _tied(model: nn.Module) -> set[str]:
    """Parameters filled by weight tying rather than by the checkpoint."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    configs = (model.config, model.config.get_text_config())  # Janus sets it on the top config
    if not any(getattr(c, "tie_word_embeddings", False) for c in configs):
        return set()
    return set(tied if isinstance(tied, (list, set)) else tied.keys())


def _remove_tree(folder: str) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def input_device(model: nn.Module) -> torch.device:
    """Where inputs go: the device of the first module (``hf_device_map``), else of the weights."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        first = next(iter(device_map.values()))
        if first in ("cpu", "disk"):
            return torch.device("cpu")
        return torch.device(first if not isinstance(first, int) else f"cuda:{first}")
    return next(model.parameters()).device
