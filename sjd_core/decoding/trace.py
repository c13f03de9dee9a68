"""What happened during a generation: per iteration and per slot, and the summaries of both.

During decoding :class:`TraceRecorder` keeps references to what the engine made, on the
model's device (no operation and no read back per iteration); ``finish`` lays them out and turns
them into a :class:`Trace` of plain numpy arrays that serialises to JSON and feeds
the diagnostics heatmaps.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ..files import parse_json
from ..messages import first_line, plural, quote
from .drafting import DRAFT_SOURCES
from .verify import ACCEPTED, BONUS, COMMIT_KINDS, FORCED, RELAXED, RESIDUAL

_NEVER = 2**31 - 1
FORCED_MASS = 1.0 - 1e-6  # a target this sure of one code left no choice: a forced slot
# What VP's consecutive rises predicted, counted over committed slots that had a history: the
# slots, those whose committed code had risen, those where some code had, and those where the
# likeliest code that had risen was the committed one.
RISE_COUNTS = ("slots", "committed_code_rose", "some_code_rose", "likeliest_riser_committed")
TRACE_VERSION = 2
COMPILE_NOTED = 0.5  # seconds of compiling from which the summary line mentions it


class Clock:
    """Marks points in time without synchronising: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds_between(self, first: int, last: int) -> float | None:
        """Seconds from mark ``first`` to mark ``last``; None while the device has not passed
        them yet (never waits)."""
        if last >= len(self.marks):
            return None
        a, b = self.marks[first], self.marks[last]
        if self.cuda:
            return a.elapsed_time(b) / 1000.0 if b.query() else None
        return b - a

    def phases(self, per_iteration: int) -> np.ndarray:
        """(iterations, per_iteration - 1) seconds between an iteration's consecutive marks.

        Synchronises once, at the end.
        """
        groups = [self.marks[i:i + per_iteration]
                  for i in range(0, len(self.marks) - per_iteration + 1, per_iteration)]
        if self.cuda:
            torch.cuda.synchronize()
            span = [[a.elapsed_time(b) / 1000.0 for a, b in zip(g, g[1:])] for g in groups]
        else:
            span = [np.diff(g).tolist() for g in groups]
        return np.array(span, dtype=np.float64).reshape(len(groups), per_iteration - 1)


class _Entered(NamedTuple):
    """Slots fed in the window at one iteration (flat indices)."""

    iteration: int
    index: torch.Tensor


class _Commits(NamedTuple):
    """Slots committed at one iteration, as ``TraceRecorder.committed_slots`` takes them."""

    iteration: int
    index: torch.Tensor
    top_mass: torch.Tensor
    kinds: torch.Tensor | None
    probability: torch.Tensor | None
    sources: torch.Tensor | None


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts flattened and joined, in order."""
    return torch.cat([part.flatten() for part in parts])


def _iteration_of_each(records: list[_Entered] | list[_Commits], device: torch.device
                       ) -> torch.Tensor:
    """For ``_joined`` indices of ``records``, the iteration each came from (int32)."""
    counts = [r.index.numel() for r in records]
    iterations = torch.tensor([r.iteration for r in records], dtype=torch.int32, device=device)
    return torch.repeat_interleave(iterations, torch.tensor(counts, device=device),
                                   output_size=sum(counts))


class TraceRecorder:
    """Keeps what every iteration recorded, as the device tensors the engine made, and lays it
    out per slot once, in ``finish``.

    An iteration only appends references (no operation, no read back); ``finish`` joins each
    record's tensors and writes them with one scatter. Slot records are flat (B * (slots + 1),):
    index ``row * (slots + 1) + slot``, where the extra column of each row absorbs writes for
    slots past the grid. The clock takes four marks per iteration: its start, the network's
    start and end (marked by the session), its end.
    """

    def __init__(self, batch: int, slots: int, device: torch.device) -> None:
        self.batch, self.slots, self.device = batch, slots, device
        self._entered: list[_Entered] = []
        self._commits: list[_Commits] = []
        self._rises: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.committed: list[list[int]] = []  # per iteration, per image of the batch
        self.shape_index: list[int] = []
        self.shapes: list[str] = []
        self.clock = Clock(device)

    def entered_window(self, iteration: int, flat_index: torch.Tensor) -> None:
        """Slots (flat indices) fed in the window at ``iteration``."""
        self._entered.append(_Entered(iteration, flat_index))

    def committed_slots(self, iteration: int, flat_index: torch.Tensor, top_mass: torch.Tensor,
                        kinds: torch.Tensor | None = None, probability: torch.Tensor | None = None,
                        sources: torch.Tensor | None = None) -> None:
        """Record the slots committed at ``iteration`` (flat indices; the trash column where not).

        ``top_mass``: the largest probability of each slot's target; at ``FORCED_MASS`` or above
        the slot counts as forced (the model left no choice) unless a relaxed rule accepted it.
        ``kinds`` (``COMMIT_KINDS``): None for plain autoregression's draws, which are recorded
        as bonus draws. Without ``probability`` and ``sources`` (no draft was tested) the slots
        keep NaN and "no draft"; a slot never recorded as fed counts as fed once, when it was
        committed.
        """
        self._commits.append(_Commits(iteration, flat_index, top_mass, kinds, probability, sources))

    def count_rises(self, counted: torch.Tensor, rose: torch.Tensor, any_rose: torch.Tensor,
                    likeliest: torch.Tensor) -> None:
        """Record, over the committed slots ``counted`` (B, L), VP's three hits (see
        ``RISE_COUNTS``); they are added up in ``finish``."""
        self._rises.append((counted, rose, any_rose, likeliest))

    def _slot_records(self) -> dict[str, torch.Tensor]:
        """The per-slot records, flat: each record's tensors joined and written at once (a slot
        is committed once; only the trash column is written more than once)."""
        size, device = self.batch * (self.slots + 1), self.device
        entered = torch.full((size,), _NEVER, dtype=torch.int32, device=device)
        commit_iteration = torch.full((size,), -1, dtype=torch.int32, device=device)
        kind = torch.zeros(size, dtype=torch.int8, device=device)
        probability = torch.full((size,), float("nan"), device=device)
        source = torch.zeros(size, dtype=torch.int8, device=device)
        if self._entered:
            entered.scatter_reduce_(0, _joined([r.index for r in self._entered]),
                                    _iteration_of_each(self._entered, device), reduce="amin")
        commits = self._commits
        if commits:
            index = _joined([r.index for r in commits])
            commit_iteration.scatter_(0, index, _iteration_of_each(commits, device))
            bonus = torch.tensor(BONUS, dtype=torch.int8, device=device)
            kinds = _joined([bonus.expand(r.index.numel()) if r.kinds is None
                             else r.kinds.to(torch.int8) for r in commits])
            forced = (_joined([r.top_mass for r in commits]) >= FORCED_MASS) & (kinds != RELAXED)
            kind.scatter_(0, index, torch.where(forced, FORCED, kinds))
            tested = [r for r in commits if r.probability is not None]
            if tested:
                tested_index = _joined([r.index for r in tested])
                probability.scatter_(0, tested_index,
                                     _joined([r.probability for r in tested]).to(torch.float32))
                source.scatter_(0, tested_index,
                                _joined([r.sources for r in tested]).to(torch.int8))
        return {"entered": entered, "commit_iteration": commit_iteration, "kind": kind,
                "probability": probability, "source": source}

    def _rise_counts(self) -> list[int] | None:
        """VP's counts over the whole generation (``RISE_COUNTS``), None when nothing was
        recorded."""
        if not self._rises:
            return None
        counted, rose, any_rose, likeliest = (_joined([r[i] for r in self._rises])
                                              for i in range(4))
        some = counted & any_rose
        return torch.stack([counted, counted & rose, some, some & likeliest]).sum(1).tolist()

    def iteration_done(self, rows: list[int], accepted: list[int], shape: str) -> None:
        """Host-side record of one iteration: slots committed per image, and the shape fed."""
        counts = [0] * self.batch
        for row, count in zip(rows, accepted):
            counts[row] = count
        self.committed.append(counts)
        if shape not in self.shapes:
            self.shapes.append(shape)
        self.shape_index.append(self.shapes.index(shape))

    def finish(self, grid: tuple[int, int], meta: dict[str, Any]) -> "Trace":
        """Read everything back once and build the host-side trace."""
        height, width = grid
        batch = self.batch

        def to_grid(x: torch.Tensor) -> np.ndarray:
            return x.view(batch, self.slots + 1)[:, : self.slots].reshape(
                batch, height, width).cpu().numpy()

        slot = self._slot_records()
        commit = to_grid(slot["commit_iteration"])
        entered = to_grid(slot["entered"])
        entered = np.where(entered == _NEVER, commit, entered)  # committed without being fed
        seconds = self.clock.phases(4)  # start, network start, network end, end
        iterations = len(self.committed)
        if seconds.shape[0] != iterations:
            raise RuntimeError(f"the clock has {seconds.shape[0]} complete iterations of marks for "
                               f"{iterations} iterations: a session must call mark() twice per "
                               "forward")
        rises = self._rise_counts()
        if rises is not None:
            meta = dict(meta, vp_rises=dict(zip(RISE_COUNTS, rises)))
        return Trace(
            meta=dict(meta, run_id=uuid.uuid4().hex, grid=[height, width], batch=batch,
                      shapes=list(self.shapes), trace_version=TRACE_VERSION),
            committed_per_iteration=np.array(self.committed, dtype=np.int64).reshape(
                iterations, batch),
            forward_seconds=seconds[:, 1],
            other_seconds=seconds[:, 0] + seconds[:, 2],
            shape_per_iteration=np.array(self.shape_index, dtype=np.int64),
            commit_iteration=commit.astype(np.int64),
            iterations_in_window=(commit - entered + 1).astype(np.int64),
            acceptance_probability=to_grid(slot["probability"]).astype(np.float64),
            commit_kind=to_grid(slot["kind"]).astype(np.int64),
            draft_source=to_grid(slot["source"]).astype(np.int64),
        )


@dataclass
class Trace:
    """A finished generation's record; plain numpy, JSON-serialisable.

    Per iteration: slots committed per row, the network's seconds, the seconds spent on
    everything else, and the shape fed (``meta["shapes"]``). Per slot (B, H, W): the iteration
    that committed it, how many iterations it was fed in the window, the acceptance probability
    of its test at commit (NaN when no draft was tested, e.g. plain autoregression), how it was
    committed (``COMMIT_KINDS``) and how the tested draft was made (``DRAFT_SOURCES``).
    """

    meta: dict[str, Any]
    committed_per_iteration: np.ndarray  # (I, B)
    forward_seconds: np.ndarray  # (I,) the network
    other_seconds: np.ndarray  # (I,) everything else: inputs, drafting, verifying, bookkeeping
    shape_per_iteration: np.ndarray  # (I,) index into meta["shapes"] of what was fed
    commit_iteration: np.ndarray  # (B, H, W)
    iterations_in_window: np.ndarray
    acceptance_probability: np.ndarray
    commit_kind: np.ndarray
    draft_source: np.ndarray  # (B, H, W) how the tested draft was made (DRAFT_SOURCES)
    _arrays: tuple[str, ...] = field(default=("committed_per_iteration", "forward_seconds",
                                              "other_seconds", "shape_per_iteration",
                                              "commit_iteration", "iterations_in_window",
                                              "acceptance_probability", "commit_kind",
                                              "draft_source"), repr=False)

    def row_nfe(self) -> np.ndarray:
        """Forward passes each row needed: the last iteration in which it committed, plus one."""
        active = self.committed_per_iteration > 0
        iterations = np.arange(1, active.shape[0] + 1)[:, None]
        return np.where(active, iterations, 0).max(axis=0)

    def accepted_lengths(self) -> np.ndarray:
        """Slots committed per (iteration, row) while the row was still decoding."""
        return self.committed_per_iteration[self.committed_per_iteration > 0]

    def summary(self) -> dict[str, Any]:
        """NFE, step compression, accepted lengths and timings, averaged over the batch rows."""
        height, width = self.meta["grid"]
        nfe = self.row_nfe()
        lengths = self.accepted_lengths()
        histogram = np.bincount(lengths, minlength=int(self.meta.get("window", 1)) + 1)[1:]
        kinds = {name: int((self.commit_kind == code).sum()) for code, name in COMMIT_KINDS.items()
                 if code}
        forward = float(self.forward_seconds.sum())
        other = float(self.other_seconds.sum())
        return {
            "mode": self.meta.get("mode", "?"),
            "lossless": bool(self.meta.get("lossless", True)),
            "run_id": self.meta["run_id"],
            "slots_per_image": height * width,
            "batch": int(self.meta["batch"]),
            "iterations": int(self.committed_per_iteration.shape[0]),
            "nfe": float(nfe.mean()) if nfe.size else 0.0,
            "step_compression": float((height * width / np.maximum(nfe, 1)).mean()),
            "mean_accepted_length": float(lengths.mean()) if lengths.size else 0.0,
            "accepted_length_histogram": histogram.tolist(),
            "commit_kinds": kinds,
            "forward_seconds": forward,
            "other_seconds": other,
            "total_seconds": forward + other,
            "other_share": other / (forward + other) if forward + other > 0 else 0.0,
            "shapes": {shape: int((self.shape_per_iteration == index).sum())
                       for index, shape in enumerate(self.meta.get("shapes", []))},
            "draft_sources": {name: int(((self.draft_source == code)
                                         & (self.commit_kind == ACCEPTED)).sum())
                              for code, name in DRAFT_SOURCES.items() if code},
            "drafts_tested": {name: int(((self.draft_source == code)
                                         & np.isin(self.commit_kind, (ACCEPTED, RESIDUAL))).sum())
                              for code, name in DRAFT_SOURCES.items() if code},
            "warnings": [str(w) for w in self.meta.get("warnings", [])],
            "auto_choice": self.meta.get("auto_choice"),
            "compile_seconds": sum(self.meta.get(name, {}).get("compile_seconds", 0.0)
                                   for name in ("compile", "compile_stages")),
            "unconditional": bool(self.meta.get("unconditional", False)),
            "vp_rises": dict(self.meta.get("vp_rises", {})),
        }

    def slot_maps(self) -> dict[str, np.ndarray]:
        """The per-slot (B, H, W) arrays the diagnostics heatmaps are drawn from."""
        return {name: getattr(self, name) for name in
                ("commit_iteration", "iterations_in_window", "acceptance_probability",
                 "commit_kind", "draft_source")}

    def to_json(self) -> str:
        """JSON text; NaN acceptance probabilities become null."""
        body: dict[str, Any] = {"meta": self.meta}
        for name in self._arrays:
            array = getattr(self, name)
            values = np.where(np.isnan(array), None, array).tolist() if array.dtype.kind == "f" \
                else array.tolist()
            body[name] = {"shape": list(array.shape), "dtype": str(array.dtype),
                          "values": values}
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        """Inverse of :meth:`to_json`; ValueError when the text is not a complete, consistent
        trace of this version (see :meth:`validate`)."""
        body = parse_json(text, "trace: the text", "pass what Trace.to_json wrote")
        if not isinstance(body, dict) or not isinstance(body.get("meta"), dict):
            raise ValueError("trace: the text is not a trace written by Trace.to_json (it has no "
                             "'meta' object).")
        if "trace_version" not in body["meta"]:
            raise ValueError("trace: the text is not a trace written by Trace.to_json (its meta "
                             "has no trace_version).")
        version = body["meta"]["trace_version"]
        if version != TRACE_VERSION:
            raise ValueError(f"trace: trace_version={quote(version)} is not supported: this pack "
                             f"reads trace version {TRACE_VERSION}; run the sampler again for a "
                             "new trace.")
        arrays = {}
        for name in cls.__dataclass_fields__["_arrays"].default:
            kind = _FLOAT_ARRAYS.get(name, np.int64)
            try:
                entry = body[name]
                values = np.array(entry["values"], dtype=object)
                if kind is np.float64:
                    values = np.where(values == None, np.nan, values)  # noqa: E711
                arrays[name] = values.astype(kind).reshape(entry["shape"])
            except (KeyError, TypeError, ValueError, OverflowError) as error:
                raise ValueError(f"trace: array {quote(name)} is missing or unreadable "
                                 f"({first_line(error)}); pass what Trace.to_json wrote.") from error
        trace = cls(meta=body["meta"], **arrays)
        trace.validate()
        return trace

    def validate(self) -> None:
        """Check that the arrays agree with the meta and with each other; ValueError if not.

        Every array must have the shape the meta's grid, batch and the iteration count give,
        every row must commit each slot of its grid exactly once, and codes must be known ones.
        """
        height, width, batch, shapes = _checked_meta(self.meta)
        iterations = self.committed_per_iteration.shape[0]
        expected = {"committed_per_iteration": (iterations, batch),
                    "forward_seconds": (iterations,), "other_seconds": (iterations,),
                    "shape_per_iteration": (iterations,)}
        expected.update({name: (batch, height, width) for name in self.slot_maps()})
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(
                    f"trace: array {quote(name)} has shape {actual}, but the meta (grid "
                    f"{height}x{width}, batch {batch}) and {plural(iterations, 'iteration')} make it "
                    f"{shape}: the trace was edited or put together from different runs.")
        committed = self.committed_per_iteration
        if (committed < 0).any() or (committed.sum(0) != height * width).any():
            raise ValueError(f"trace: committed_per_iteration sums to {committed.sum(0).tolist()} "
                             f"slots per image, not {height * width} (grid {height}x{width}): "
                             "the trace does not belong to its meta.")
        self._check_values(len(shapes), iterations)

    def _check_values(self, shapes: int, iterations: int) -> None:
        """Indices within their tables, probabilities in [0, 1], seconds finite and >= 0."""
        checks = (
            ("shape_per_iteration", self.shape_per_iteration, 0, shapes - 1),
            ("commit_iteration", self.commit_iteration, 0, iterations - 1),
            ("iterations_in_window", self.iterations_in_window, 1, iterations),
            ("commit_kind", self.commit_kind, min(COMMIT_KINDS), max(COMMIT_KINDS)),
            ("draft_source", self.draft_source, min(DRAFT_SOURCES), max(DRAFT_SOURCES)),
        )
        for name, values, low, high in checks:
            if values.size and (values.min() < low or values.max() > high):
                raise ValueError(f"trace: {name} holds values in [{values.min()}, "
                                 f"{values.max()}], outside [{low}, {high}]: the trace was edited "
                                 "or is damaged; run the sampler again for a new trace.")
        probability = self.acceptance_probability[~np.isnan(self.acceptance_probability)]
        seconds = np.concatenate([self.forward_seconds, self.other_seconds])
        if ((probability < 0) | (probability > 1)).any() or not np.isfinite(seconds).all() \
                or (seconds < 0).any():
            raise ValueError("trace: acceptance probabilities must lie in [0, 1] and seconds must "
                             "be finite and >= 0: the trace was edited or is damaged; run the "
                             "sampler again for a new trace.")


def _positive(name: str, value: object) -> int:
    """``value`` if it is a positive integer; ValueError naming the meta entry otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"trace: meta {name}={quote(value)} is not allowed: it must be a "
                         "positive integer.")
    return value


def _checked_meta(meta: dict) -> tuple[int, int, int, list[str]]:
    """A trace meta's grid height and width, batch and shape labels, each checked."""
    grid = meta.get("grid")
    if not isinstance(grid, (list, tuple)) or len(grid) != 2:
        raise ValueError(f"trace: meta grid={quote(grid)} is not allowed: it must be [height, "
                         "width] in code slots.")
    height, width = _positive("grid height", grid[0]), _positive("grid width", grid[1])
    batch = _positive("batch", meta.get("batch"))
    _positive("window", meta.get("window", 1))
    if not isinstance(meta.get("run_id"), str):
        raise ValueError(f"trace: meta run_id={quote(meta.get('run_id'))} is not allowed: it "
                         "must be the string the sampler wrote.")
    for name, kind, allowed in (("warnings", list, "a list of strings"),
                                ("vp_rises", dict, "an object"), ("mode", str, "a string"),
                                ("unconditional", bool, "true or false")):
        if name in meta and not isinstance(meta[name], kind):
            raise ValueError(f"trace: meta {name}={quote(meta[name])} is not allowed: it must "
                             f"be {allowed}.")
    shapes = meta.get("shapes", [])
    if not isinstance(shapes, list) or not all(isinstance(x, str) for x in shapes):
        raise ValueError(f"trace: meta shapes={quote(shapes)} is not allowed: it must be a "
                         "list of strings.")
    return height, width, batch, shapes


_FLOAT_ARRAYS = {"forward_seconds": np.float64, "other_seconds": np.float64,
                 "acceptance_probability": np.float64}


def shape_counts_text(shapes: dict[str, int], shown: int | None = None) -> str:
    """``window 16 x200, window 32 x30``: iterations per shape fed, most first; past ``shown``
    shapes, how many more there were."""
    ordered = sorted(shapes.items(), key=lambda item: -item[1])
    text = ", ".join(f"{name} x{count}" for name, count in ordered[:shown])
    hidden = len(ordered) - len(ordered[:shown])
    return text + (f", {hidden} more" if hidden else "")


def summary_text(summary: dict[str, Any]) -> str:
    """One human line from :meth:`Trace.summary`; the shapes fed when there were several."""
    text = (f"{summary['mode']}{'' if summary['lossless'] else ' (LOSSY)'}"
            f"{', unconditional (empty prompt)' if summary.get('unconditional') else ''}: "
            f"{plural(round(summary['nfe']), 'forward pass', 'forward passes')} for "
            f"{plural(summary['slots_per_image'], 'code')} "
            f"(step compression {summary['step_compression']:.2f}x, mean accepted length "
            f"{summary['mean_accepted_length']:.2f}), {summary['total_seconds']:.2f} s")
    shapes = summary.get("shapes", {})
    if len(shapes) > 1:
        text += "; steps by shape: " + shape_counts_text(shapes, shown=4)
    if summary.get("auto_choice"):
        text += f"; fed {summary['auto_choice']}"
    if summary.get("compile_seconds", 0.0) >= COMPILE_NOTED:
        text += f"; compiling took {summary['compile_seconds']:.1f} s (once per process)"
    return text + "".join(f". WARNING: {w}" for w in summary.get("warnings", []))
