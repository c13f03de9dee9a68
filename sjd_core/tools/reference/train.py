"""Train the embedded reference model from scratch: ``python -m sjd_core.tools.reference.train``.

Three parts, each seeded, run in order and written to ``--out`` (the shipped ``weights/`` folder by
default):

1. ``codebook``: k-means (512 codes) over 2x2 patches of Fashion-MNIST's training images padded
   to 32x32, so each image is a 16x16 grid of codes (``codebook.safetensors``).
2. ``model``: a stock transformers ``LlamaForCausalLM`` (4 layers, width 256) learns
   ``[class token, c_0 .. c_255]`` with next-token cross-entropy on the codes. 10% of the class
   tokens are replaced by a null class so that classifier-free guidance works
   (``config.json``, ``model.safetensors``, ``reference.json``).
3. ``classifier``: the small CNN of the quality probe (``classifier.safetensors``).

The data is Debian's ``dataset-fashion-mnist`` package (see ``data.INSTALL_HINT``). ``--tiny``
trains a toy-sized model on synthetic arrays in seconds, to test this script without the data.
With the default settings the parts took 44 s (codebook), 2 min (tokenising the training set)
+ 22 min (800 optimiser steps) and 97 s (classifier) with ``--threads 1`` on a 2-core machine
shared with other work: about 26 minutes in all.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from ...models.reference import codebook as cb
from .data import DEFAULT_DATA_DIR, load_split, synthetic_split
from ...models.reference.prompts import CLASS_NAMES, SYNONYMS

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
PARTS = ("codebook", "model", "classifier")
NULL_CLASS = len(CLASS_NAMES)  # class index of "no prompt", used for classifier-free guidance
# Sampling recipe stored with the weights (reference.json) and used by default.
DEFAULT_SAMPLING = {"guidance": 2.0, "temperature": 1.0, "top_k": 0, "top_p": 0.9}


def llama_config(codebook_size: int, tiny: bool) -> LlamaConfig:
    """The reference architecture; vocabulary = codes, then the 10 class tokens, then null."""
    width, layers, heads, ffn = (32, 2, 2, 64) if tiny else (256, 4, 4, 704)
    return LlamaConfig(
        vocab_size=codebook_size + NULL_CLASS + 1,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=cb.GRID * cb.GRID + 1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def train_codebook(images: torch.Tensor, size: int, sample: int, iterations: int,
                   generator: torch.Generator) -> torch.Tensor:
    """k-means over a random sample of the training images' 2x2 patches."""
    patches = cb.to_patches(images).reshape(-1, cb.PATCH * cb.PATCH)
    pick = torch.randperm(patches.shape[0], generator=generator)[:sample]
    return cb.kmeans(patches[pick], size, iterations, generator)


def sequences(codes: torch.Tensor, labels: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """(N, H, W) codes and (N,) class indices -> (N, 1 + H*W) token ids ``[class, codes...]``."""
    return torch.cat([(labels + codebook_size)[:, None], codes.reshape(codes.shape[0], -1)], 1)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 5% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def sequence_loss(model: LlamaForCausalLM, ids: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """Cross-entropy of each code given the class token and the codes before it."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids[:, :-1]).logits
    logits = logits.float()[..., :codebook_size]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, codebook_size), ids[:, 1:].reshape(-1))


def train_model(train_ids: torch.Tensor, test_ids: torch.Tensor, config: LlamaConfig, steps: int,
                batch: int, peak_lr: float, label_dropout: float, generator: torch.Generator,
                log_every: int) -> LlamaForCausalLM:
    """Train the Llama on token sequences; class tokens dropped to null with ``label_dropout``."""
    codebook_size = config.vocab_size - NULL_CLASS - 1
    torch.manual_seed(int(torch.randint(2**31, (1,), generator=generator)))  # weight init
    model = LlamaForCausalLM(config)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": other, "weight_decay": 0.0}],
                                  lr=peak_lr, betas=(0.9, 0.95))
    warmup = max(1, min(100, steps // 10))
    order = torch.randperm(train_ids.shape[0], generator=generator)
    cursor = 0
    started = time.time()
    for step in range(steps):
        if cursor + batch > order.numel():
            order = torch.randperm(train_ids.shape[0], generator=generator)
            cursor = 0
        ids = train_ids[order[cursor:cursor + batch]].clone()
        cursor += batch
        drop = torch.rand(batch, generator=generator) < label_dropout
        ids[drop, 0] = codebook_size + NULL_CLASS
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, peak_lr, warmup)
        model.train()
        loss = sequence_loss(model, ids, codebook_size)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            model.eval()
            with torch.no_grad():
                test = sequence_loss(model, test_ids, codebook_size).item()
            elapsed = time.time() - started
            eta = elapsed / (step + 1) * (steps - step - 1)
            print(f"step {step + 1}/{steps}  train loss {loss.item():.4f}  test loss {test:.4f}  "
                  f"{elapsed / 60:.1f} min, about {eta / 60:.1f} min left", flush=True)
    model.eval()
    return model


def describe(codebook_size: int, args: argparse.Namespace) -> dict:
    """The ``reference.json`` written next to the weights: classes, layout, defaults, recipe."""
    return {
        "family": "reference",
        "classes": list(CLASS_NAMES),
        "synonyms": {name: list(words) for name, words in SYNONYMS.items()},
        "codebook_size": codebook_size,
        "class_token_offset": codebook_size,
        "null_class_token": codebook_size + NULL_CLASS,
        "grid": [cb.GRID, cb.GRID],
        "patch": cb.PATCH,
        "image_size": cb.IMAGE_SIZE,
        "defaults": DEFAULT_SAMPLING,
        "training": {"seed": args.seed, "steps": args.steps, "batch": args.batch, "lr": args.lr,
                     "label_dropout": args.label_dropout, "data": "fashion-mnist train split"
                     if not args.tiny else "synthetic arrays (--tiny)"},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sjd_core.tools.reference.train",
        description="Retrain the embedded reference model (codebook, Llama, probe classifier) "
                    "from Fashion-MNIST. Install the data with: sudo apt-get install "
                    "dataset-fashion-mnist")
    parser.add_argument("--data", default=str(DEFAULT_DATA_DIR),
                        help="folder with the Fashion-MNIST *-ubyte.gz files (default: %(default)s)")
    parser.add_argument("--out", default=str(WEIGHTS_DIR),
                        help="where the weights are written (default: the shipped weights folder)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {PARTS} to train (default: all); "
                             "'model' and 'classifier' read the codebook from --out when it is "
                             "not trained in the same run")
    parser.add_argument("--steps", type=int, default=800, help="optimiser steps for the model")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--label-dropout", type=float, default=0.1,
                        help="share of class tokens replaced by the null class (enables CFG)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--tiny", action="store_true",
                        help="toy model, 16 codes, synthetic arrays instead of the dataset (tests)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts={args.parts!r} is not allowed: use a comma-separated subset of {PARTS}")
    if args.steps < 1 or args.batch < 1:
        parser.error(f"--steps={args.steps} and --batch={args.batch} must both be >= 1")
    if not 0 <= args.label_dropout < 1:
        parser.error(f"--label-dropout={args.label_dropout} must be in [0, 1)")
    args.parts = parts
    return args


def main(argv: list[str] | None = None) -> Path:
    """Run the requested parts; returns the output folder."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        train_images, train_labels = synthetic_split(256, args.seed)
        test_images, test_labels = synthetic_split(64, args.seed + 1)
        codebook_size, sample, kmeans_iterations = 16, 4096, 5
    else:
        train_images, train_labels = load_split("train", args.data)
        test_images, test_labels = load_split("test", args.data)
        codebook_size, sample, kmeans_iterations = 512, 400_000, 30
    train_images, test_images = torch.from_numpy(train_images.copy()), torch.from_numpy(test_images.copy())
    train_labels, test_labels = torch.from_numpy(train_labels), torch.from_numpy(test_labels)
    def generator() -> torch.Generator:
        """Each part draws from its own stream, so parts retrained alone give the same result."""
        return torch.Generator().manual_seed(args.seed)

    if "codebook" in args.parts:
        started = time.time()
        codebook = train_codebook(train_images, codebook_size, sample, kmeans_iterations, generator())
        save_file({"codebook": codebook.contiguous()}, str(out / "codebook.safetensors"))
        recon = cb.decode(cb.encode(test_images, codebook), codebook)
        target = torch.nn.functional.pad(test_images.float() / 255, (cb.PAD,) * 4)
        print(f"codebook: {codebook_size} codes in {time.time() - started:.0f} s, test "
              f"reconstruction RMSE {((recon - target) ** 2).mean().sqrt():.4f} (pixels 0..1)",
              flush=True)
    if "model" in args.parts:
        from safetensors.torch import load_file
        codebook = load_file(str(out / "codebook.safetensors"))["codebook"]
        started = time.time()
        train_ids = sequences(cb.encode(train_images, codebook), train_labels, codebook.shape[0])
        test_ids = sequences(cb.encode(test_images[:500], codebook), test_labels[:500],
                             codebook.shape[0])
        print(f"encoded {train_ids.shape[0]} training images in {time.time() - started:.0f} s",
              flush=True)
        config = llama_config(codebook.shape[0], args.tiny)
        model = train_model(train_ids, test_ids, config, args.steps, args.batch, args.lr,
                            args.label_dropout, generator(), log_every=max(1, min(100, args.steps)))
        model.to(torch.float16).save_pretrained(str(out))
        (out / "generation_config.json").unlink(missing_ok=True)
        (out / "reference.json").write_text(json.dumps(describe(codebook.shape[0], args), indent=2)
                                            + "\n")
        print(f"model written to {out}", flush=True)
    if "classifier" in args.parts:
        from .probe import train_classifier
        train_classifier(train_images, train_labels, test_images, test_labels, out,
                         steps=60 if args.tiny else 1500, seed=args.seed)
    return out


if __name__ == "__main__":
    main()
