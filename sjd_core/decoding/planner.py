"""Which shape each iteration feeds: the mode's own shape, or the one ``auto`` expects to pay most.

A plan answers ``choose()`` before every iteration with a :class:`~.drafting.DraftTree` and is
told afterwards what that iteration committed (``observe``). Because the choice uses only
iterations that are over, it never depends on the draws of the iteration it shapes, and every
lossless shape, chosen this way, keeps the output exactly the model's distribution.

``auto`` (:class:`AutoPlan`) picks among plain autoregression, windows of several lengths and
windows with a proactive-drafting tree the shape expected to commit the most codes per second on
this model and machine (see the class docstring).
"""

from __future__ import annotations

import math
import numbers
import statistics
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from ..messages import first_line, quote
from ..models.protocol import GenerationRequest, ImageTokenModel
from .drafting import DraftTree, tree_profiles, uniform_profile
from .settings import AccelerationSettings, SamplingSettings, tree_nodes


def describe_shape(tree: DraftTree) -> str:
    """A short label: ``AR``, ``window 8``, ``window 16, PD 4x3`` (K candidates at each of the
    D - 1 tree levels, depth D counting the root) or ``window 16, PD 4-2`` (candidates per level,
    where the levels differ)."""
    if tree.window == 1:
        return "AR"
    if tree.tree_levels:
        uniform = len(set(tree.profile)) == 1
        return f"window {tree.window}, PD " + (f"{tree.branching}x{tree.tree_levels + 1}"
                                               if uniform else "-".join(map(str, tree.profile)))
    return f"window {tree.window}"


class Plan(Protocol):
    """Chooses the shape of every iteration."""

    mode_name: str
    warnings: list[str]  # what went wrong and what the plan did instead, for the run's summary

    def choose(self) -> DraftTree:
        """The shape of the next iteration."""
        ...

    def observe(self, tree: DraftTree, rows: list[int], accepted: list[int], warm: bool,
                siblings: tuple[int, int], timed: bool = True) -> None:
        """What the iteration just fed as ``tree`` committed for each image ``rows[i]``;
        ``warm`` is False when its drafts were only just initialised; ``siblings``: PD
        candidates 2..K tested along the accepted paths, and how many of them passed;
        ``timed`` False: its time says nothing of its shape's cost (the network compiled)."""
        ...

    def notes(self) -> dict:
        """What the plan wants recorded in the trace's meta."""
        ...


class FixedPlan:
    """Every iteration feeds the shape the settings name."""

    def __init__(self, settings: AccelerationSettings, device: torch.device) -> None:
        self.tree = DraftTree.for_settings(settings, device)
        self.mode_name = settings.mode_name
        self.warnings: list[str] = []

    def choose(self) -> DraftTree:
        return self.tree

    def observe(self, tree: DraftTree, rows: list[int], accepted: list[int], warm: bool,
                siblings: tuple[int, int], timed: bool = True) -> None:
        return None

    def notes(self) -> dict:
        return {}


_MEMORY = 0.98  # per counted iteration: what the acceptance counts remember
_HYSTERESIS = 0.05  # another shape must be expected this much faster to be switched to
_LEARNING_SHARE = 0.05  # the most of a generation's time that learning may cost (see AutoPlan)
_PROBE = 64  # iterations between the first two runs of the longest window if it is the best
_PROBE_RUN = 10  # iterations per run of the longest window; the first few settle, uncounted
_FIRST_PROBE_RUN = 30  # the first run of a profile, if the budget covers it: estimates start here
_SETTLE = 5  # iterations of a run not counted: slots it adds were never fed before
_PRIOR_HAZARD = 0.3  # rejection rate assumed before any draft was tested
_TIMING_SETTLE = 3  # iterations of a run that are not timed: a shape's first forward in a
# process or after the prefill can take several times its usual time, and after a switch of shape
# (or a compile) the next few still run slower
_TIMED_RUN = 12  # iterations of AR that a new profile times
_AR_PROBE_RUN = 30  # iterations of a probe run of AR: on a CPU AR's first 15 to 25 steps after
# other work run up to twice as slow, and its seconds are the median of the last nine
_OPENING_RUN = 12  # iterations of each window that a new profile times and counts drafts on
_RECENT_TIMES = 9  # a shape's seconds: the median of its last this many times
_UNDERRATED = 0.15  # about what counts made on a shorter window underrate a longer one by
_NEXT_TURN = 8  # iterations before the next turn, where a turn passed without a run
_ESTIMATE_EVERY = 32  # iterations between two estimates of every shape's rate (and right after
# a learning run): between learning runs the estimate moves slowly, and making it costs more
# than a lean AR step's bookkeeping should
# iterations a new profile learns before it feeds what it expects to pay most (its opening and
# the longest window's first run); a measurement of what auto settles on starts after them
LEARNING_ITERATIONS = _TIMED_RUN + _OPENING_RUN + _FIRST_PROBE_RUN
_LENGTHS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

@dataclass
class _Profile:
    """What ``auto`` learnt about one model, device, batch and settings; kept across generations.

    ``at_risk``/``stopped``: decayed counts of drafts tested and rejected at each depth of a
    window (a draft at depth j is tested when the j - 1 before it passed). ``sibling_tests`` and
    ``sibling_passes``: decayed counts of PD candidates 2..K tested (where the ones before them
    failed) and passed. ``seconds``: seconds per iteration by fed node count (1: the plain
    autoregressive step), the median of the last ``_RECENT_TIMES`` (one time that the machine
    stretched, another process or a pause, moves it not at all); ``fastest``: the fastest time
    of each node count (what a shape costs at best).
    """

    window: int
    at_risk: np.ndarray = None
    stopped: np.ndarray = None
    sibling_tests: float = 0.0
    sibling_passes: float = 0.0
    seconds: dict[int, float] = field(default_factory=dict)
    fastest: dict[int, float] = field(default_factory=dict)
    recent: dict[int, deque] = field(default_factory=dict)  # the times behind ``seconds``
    fed: set[int] = field(default_factory=set)  # compiled: the shapes fed at full batch (index)
    opened: bool = False  # the opening runs were queued (see AutoPlan)
    until_probe: int | None = None  # iterations left before the next run of the longest window;
    # None: a run just ended, and the next choice sets it from what the run measured
    probes_made: int = 0  # probe turns so far (in turn: the longest window, its tree)
    windows_run: int = 0  # probe runs of the longest window or its tree made so far
    cut_short: int = 0  # probe runs in a row the budget stopped before any draft was counted
    until_ar_turn: int | None = None  # iterations fed with a window before AR is timed again
    ar_turns: int = 0  # timing runs of AR made while a window was fed
    current: int = -1  # index of the shape the last generation ended with

    def __post_init__(self) -> None:
        self.at_risk = np.zeros(self.window)
        self.stopped = np.zeros(self.window)

    def start_image(self) -> None:
        """AR's step attends over the columns in use, so its cost grows along an image (a
        window's, over the cache's full capacity, does not): a generation starts from AR's
        fastest time, that of an image's first steps, not from its last ones, measured at the
        end of the image before."""
        if 1 in self.fastest:
            self.seconds[1] = self.fastest[1]
            self.recent[1].clear()

    def time(self, nodes: int, seconds: float) -> None:
        recent = self.recent.setdefault(nodes, deque(maxlen=_RECENT_TIMES))
        recent.append(seconds)
        self.seconds[nodes] = statistics.median(recent)
        self.fastest[nodes] = min(seconds, self.fastest.get(nodes, seconds))


@dataclass
class _Fed:
    """An iteration whose seconds were not read yet, and what they will be booked as."""

    iteration: int
    nodes: int
    prices: bool  # its seconds price its shape (a settled run at the batch's full size)
    compiling: bool  # a shape compiled in it (or may have): its seconds are nobody's cost
    learning: bool  # fed to learn (opening or probe), not as the shape expected to pay most
    codes: float  # codes it committed per image


# Profiles live as long as their model: {model: {key: _Profile}}.
_PROFILES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def largest_shape(settings: AccelerationSettings) -> int:
    """The most nodes one forward of ``settings`` feeds (for ``auto``, over all its shapes),
    counted without building the tree."""
    if not settings.proactive_drafting or (settings.adaptive_shape
                                           and settings.shape_cost == "passes"):
        return settings.window
    return tree_nodes(settings.window, settings.pd_candidates, settings.pd_depth)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept through ``(x, y)`` points with at least two distinct x
    (the plan fits it before every iteration; ``np.polyfit`` takes about 100 us for that)."""
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_y = sum(y for _, y in points) / count
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return slope, mean_y - slope * mean_x


def _middle_length(lengths: list[int]) -> int:
    """The middle window among ``lengths`` (ascending, the longest last): the longest of at
    most half the longest (or 2)."""
    return max(n for n in lengths if n <= max(lengths[-1] // 2, 2))


def _compiled_shapes(shapes: list[DraftTree], probes: list[DraftTree],
                     lengths: list[int]) -> list[DraftTree]:
    """At most 8 of ``auto``'s ``shapes``, for a compiled run, which compiles every shape it
    feeds (seconds each on a CPU): plain autoregression; five chains, the short window (4) and
    the middle one, which ``auto`` measures first, the longest, and the lengths nearest halfway
    between them; and the tree it probes (``probes[1]``), at its own window and the middle one."""
    def nearest(length: float) -> int:
        return min(lengths, key=lambda n: abs(n - length))

    middle, longest = _middle_length(lengths), lengths[-1]
    chains = {1, nearest(4), nearest(middle / 2), middle, nearest((middle + longest) / 2),
              longest}
    tree = probes[1] if len(probes) > 1 else None
    return [shape for shape in shapes if shape.window in chains and not shape.tree_levels
            or tree is not None and shape.profile == tree.profile
            and shape.window in (tree.window, min(middle, tree.window))]


def _fitting_window(profile: tuple[int, ...], budget: int) -> int:
    """The longest window whose tree of ``profile`` feeds at most ``budget`` nodes."""
    inner = int(np.cumprod(profile).sum()) if profile else 0
    return budget - inner + len(profile)


class AutoPlan:
    """Cost-aware speculation: every iteration, the shape expected to commit the most codes per
    second, and at most 5% of the time spent learning what the others would commit.

    The policy, in four parts:

    - **Estimated.** Codes per iteration of every shape, and seconds per iteration. A window of
      ``L`` slots commits ``1 + sum_{j < L} S(j)``, ``S(j)`` the chance that the first ``j`` drafts
      pass, estimated per depth (a draft at depth j counts only where the j - 1 before it passed)
      on the longest window expected to come within 15% of the best shape and on any longer one
      fed, in their settled iterations (a shorter window's drafts are refined less often and
      underrate every longer one by about that much). A tree with ``K_d`` candidates at depth d
      passes there with ``a_d = 1 - h_d (1 - r)^(K_d - 1)`` (``h_d`` the depth's rejection rate,
      ``r`` the measured chance that a further candidate passes where the ones before it failed)
      and commits ``1 + sum_{d <= m} a_1 ... a_d + sum_{m < j < L} S(j)``; with ``adaptive_tree``
      every tree within K x D competes (:func:`~.drafting.tree_profiles`). A window's seconds
      come from a least-squares line in fed nodes through the measured shapes, never below its
      own fastest time; plain autoregression (its own, leaner step) keeps its own measured time.
    - **Timed.** Every iteration, but the first three of a run of one shape (a shape's first
      forward, and the next few after a switch, run slower), one in which the network compiled
      (compiled, also every shape's first feed: torch may compile then where the engine saw no
      new graph), and one that fed fewer rows than the batch has. A shape's seconds are the
      median of its last nine times; its fastest time is kept too. Times are booked as they are read while
      learning (a run's charge counts against the budget at once), and otherwise when the rates
      are estimated again: every 32 iterations and right after a learning run. AR's step
      attends over the columns in use, so its cost grows along an image: each generation
      starts from AR's fastest time, not from the end of the image before.
    - **Probes.** Every iteration not fed as the best expected shape is learning, and is charged
      its seconds beyond what the best shape would have taken for the codes it committed. A new
      profile opens with AR and the short window (4), 12 iterations each. Then probe turns come, in
      turn the longest window and its full tree, on an interval set from what the last one
      measured (longer the slower it would be than the best shape even at the luckiest rate the
      counts allow, and growing with the square root of the turns so far), a run of 10
      iterations each. While a window is fed, AR (timed nowhere
      else then) has turns of its own, every 64 such iterations times the square root of its
      turns so far, whatever the windows' runs cost: a run of 30 iterations (on a CPU its first
      steps after other work run slower). The first window run comes
      right after the opening, 30 iterations, and is never skipped as hopeless: the short
      window's counts, made in the top rows, underrate long windows, and that run's counts
      replace them. A later one is skipped where it could not beat the best shape even with the
      luckiest acceptance the counts allow at its fastest time (:meth:`_optimistic_rates`), and
      the next turn then comes 8 iterations later. A run
      is cut short, or not made (the turn passes, and the next comes 8 iterations later; the first
      window run waits instead), where its charge at that luckiest rate would take learning past
      5% of the generation's time (so far, plus the rest of the image at the best rate), and a
      run stops early once learning has cost that much: learning costs at most
      ``_LEARNING_SHARE`` of every generation, the opening included (give or take the iterations
      whose seconds are still being read). Probes are priced at their luck, not at their
      expected rate, because a shape's times are measured again only when it runs: a run slowed
      by another process would otherwise price every later run of its shape out, and ``auto``
      would feed AR for as long as the model stays loaded. A probe run stopped before any of
      its drafts was counted (its first five iterations) doubles the interval to the next turn,
      until a run is counted again: on a short image, a few unlucky iterations of a costly
      window can spend the budget every time.
    - **Fed.** Between probes, the shape of the highest expected rate, switched to only if it
      promises 5% more than the current one; that is plain autoregression wherever no window
      pays, and a new profile starts from it.

    What is learnt is kept for the next generation with the same model, device, batch and
    settings. Where the network or the stages are compiled, every shape fed compiles, so the
    shapes are a few that span the windows (:func:`_compiled_shapes`, at most 8), and the first
    image feeds each of them once, after its opening, so that no later image stalls to compile
    one (those iterations are neither timed nor charged). If the clock fails (any exception, or
    a time that is not a finite positive number), the rest of the generation feeds the longest
    window, and ``warnings`` says so.
    """

    def __init__(self, settings: AccelerationSettings, model: ImageTokenModel,
                 request: GenerationRequest, sampling: SamplingSettings, device: torch.device,
                 seconds_of: Callable[[int], float | None], image_codes: int) -> None:
        self.settings, self.device = settings, device
        self.batch_size = request.batch_size
        self.mode_name = settings.mode_name
        self.seconds_of = seconds_of  # seconds of iteration i, None while not known yet
        self.per_pass = settings.shape_cost == "passes"
        lengths = [n for n in _LENGTHS if n < settings.window] + [settings.window]
        self._build_shapes(settings, device, lengths)
        key = (str(device), request.batch_size, sampling, settings, request.resolution)
        try:
            profiles_of_model = _PROFILES.setdefault(model, {})
        except TypeError:  # a model that cannot be weakly referenced keeps no profile
            profiles_of_model = {}
        self.profile = profiles_of_model.setdefault(key, _Profile(settings.window))
        self.profile.start_image()
        self.short = next(t for t in self.shapes if t.window == min(4, settings.window))
        self.image_codes = image_codes
        self.codes_done = 0.0  # mean codes committed per image so far
        self.queue: list[DraftTree] = []
        self.current = max(self.profile.current, 0)  # a new profile starts from AR
        self.previous: DraftTree | None = None
        self.run = 0  # iterations in a row of the same shape
        self.learning = False  # whether the shape chosen last is fed to learn
        self.pending: list[_Fed] = []  # iterations whose seconds were not read yet
        self.elapsed = 0.0  # seconds of this generation's iterations read so far (compiles not)
        self.learning_cost = 0.0  # what the learning iterations among them cost (see _book)
        self.iteration = 0
        self.rates: np.ndarray | None = None  # the last estimate of every shape's rate
        # drafts count on windows this long or longer: in a new profile's opening, on every one
        self.counted_from = self.probes[0].window if self.profile.opened else self.short.window
        self.rates_until = 0  # the iteration from which that estimate is made again
        self.untimed = False  # the clock failed: the longest window from then on
        self.warnings: list[str] = []

    def _build_shapes(self, settings: AccelerationSettings, device: torch.device,
                      lengths: list[int]) -> None:
        """Every shape ``auto`` may feed (a few, compiled) and ``probes``: the longest window
        and its largest tree, which probe runs feed in turn."""
        self.shapes = [DraftTree.build(1, (), device)]
        self.shapes += [DraftTree.build(n, (), device) for n in lengths]
        self.probes = [self.shapes[-1]]
        if settings.proactive_drafting:
            full_tree = uniform_profile(settings.pd_candidates, settings.pd_depth)
            profiles = (tree_profiles(settings.pd_candidates, settings.pd_depth)
                        if settings.adaptive_tree else [full_tree])
            for profile in profiles:
                longest = (_fitting_window(profile, settings.window) if self.per_pass
                           else settings.window)
                self.shapes += [DraftTree.build(n, profile, device) for n in
                                sorted({n for n in lengths if n < longest} | {longest})
                                if n > len(profile)]
            trees = [shape for shape in self.shapes if shape.tree_levels]
            if trees:  # the full tree, unless a node budget leaves no room for it
                self.probes.append(max(trees, key=lambda t: (t.profile == full_tree, t.size)))
        self.compiles = settings.compiles_on(device.type) or settings.compile_stages
        if self.compiles:
            self.shapes = _compiled_shapes(self.shapes, self.probes, lengths)
        self._arrays()

    def _arrays(self) -> None:
        """The shapes as arrays, so that every shape's rate is one vector expression."""
        levels = max((len(shape.profile) for shape in self.shapes), default=0)
        self.windows = np.array([shape.window for shape in self.shapes])
        self.sizes = np.array([shape.size for shape in self.shapes], dtype=float)
        self.levels = np.array([len(shape.profile) for shape in self.shapes])
        self.candidates = np.zeros((len(self.shapes), max(levels, 1)))
        for index, shape in enumerate(self.shapes):
            self.candidates[index, :len(shape.profile)] = shape.profile
        self.in_tree = self.candidates > 0  # [shape, depth]: the depth has candidates
        self.siblings_of = np.maximum(self.candidates - 1, 0)  # candidates after the first
        self.is_tree = (self.levels > 0).astype(float)

    # ------------------------------------------------------------------ choosing
    def choose(self) -> DraftTree:
        if self.untimed:
            return self.probes[0]
        if self.queue and self._budget_left() < 0.0:  # learning cost more than expected
            self._cut_run()
        if not self.queue:
            self.queue = self._learning_run()
            if self.untimed:  # the clock failed as the times were read
                return self.probes[0]
        self.learning = bool(self.queue)
        if self.queue:
            return self.queue.pop(0)
        unfed = self.compiles and self._unfed()
        if unfed:  # the first image ended before they all compiled
            return unfed[0]
        return self.shapes[self.current]

    def _best(self, rates: np.ndarray) -> int:
        """The shape to feed between learning runs: the current one, unless another is expected
        to be ``_HYSTERESIS`` faster."""
        best = int(rates.argmax())
        if rates[best] > rates[self.current] * (1 + _HYSTERESIS):
            self.current = best
        return self.current

    def _cut_run(self) -> None:
        """Stop the run under way: learning has cost its budget. A probe run stopped before any
        of its drafts was counted taught nothing, and doubles the interval to the next turn
        (until a run is counted again): on a short image whose budget a few unlucky
        iterations of a costly window use up, every image would otherwise pay its budget for
        nothing."""
        if self.previous is not None and self.previous.window > 1 and self.run <= _SETTLE:
            self.profile.cut_short += 1
        self.queue = []

    def _estimate(self) -> None:
        """Book the times read so far, estimate every shape's rate, and settle what that
        decides: the windows whose drafts count, and the shape fed between learning runs."""
        self._read_times()
        self.rates, self.rates_until = self._rates(), self.iteration + _ESTIMATE_EVERY
        self.counted_from = self._longest_hopeful_window(self.rates)
        self._best(self.rates)

    def _learning_run(self) -> list[DraftTree]:
        """What to feed next to learn: a new profile's opening, or a probe run where one is due
        and pays its way; none otherwise. Makes the estimate of every shape's rate again every
        ``_ESTIMATE_EVERY`` iterations and right after a learning run."""
        opening = []
        if not self.profile.opened:
            self.profile.opened = True
            opening = self._opening()
        if opening or self.compiles and self._unfed():
            return opening
        if self.rates is None or self.learning or self.iteration >= self.rates_until:
            self._estimate()
        if self.current != 0 and self._ar_turn_due():
            return self._ar_run(self.rates)
        return self._probe_run(self.rates) if self._probe_due(self.rates) else []

    def _opening(self) -> list[DraftTree]:
        """A new profile's first iterations: runs that time AR and the short window and count
        the short window's drafts (where the cost is forward passes, none: every shape costs
        one), then, compiled, every other shape once."""
        runs = [] if self.per_pass else [self.shapes[0]] * _TIMED_RUN + [self.short] * _OPENING_RUN
        return runs + (self._unfed(*runs) if self.compiles else [])

    def _probe_due(self, rates: np.ndarray) -> bool:
        """Count one iteration towards the next run of the longest window; whether it is due.
        When a run ended, the interval is set from what it measured: how much slower than the
        best shape its shape would be even at its luckiest rate; doubled for every run in a row
        stopped before its drafts were counted (:meth:`_cut_run`)."""
        profile = self.profile
        if profile.until_probe is None:
            last = self.probes[(profile.probes_made - 1) % len(self.probes)]
            luckiest = self._optimistic_rates()[self.shapes.index(last)]
            cost = max(rates.max() / max(luckiest, 1e-12), 1.0)  # how slower, at best
            profile.until_probe = int(_PROBE * cost * cost * math.sqrt(profile.probes_made)
                                      * 2 ** profile.cut_short)
        profile.until_probe -= 1
        return profile.until_probe <= 0

    def _unfed(self, *to_be_fed: DraftTree) -> list[DraftTree]:
        """The shapes no iteration has fed at the batch's full size yet, but ``to_be_fed``.

        Compiled, each compiles when it is first fed so; feeding each of them once early keeps
        compiling out of every later image, where it would stall the image that first chose it."""
        return [shape for index, shape in enumerate(self.shapes) if index not in self.profile.fed
                and all(shape is not other for other in to_be_fed)]

    def _probe_run(self, rates: np.ndarray) -> list[DraftTree]:
        """The next probe turn's run: in turn the longest window and its tree. None, and the
        next turn ``_NEXT_TURN`` iterations later (skipping costs nothing), where the shape is
        fed anyway or could not beat the best one even if it were as lucky as what was counted
        allows (the first window run is made whatever its luck: the opening's counts, made on the
        short window in the top rows, underrate long windows, and its counts replace them).
        None yet where the learning budget does not cover the run priced at that luck
        (:meth:`_affordable`): the turn passes (the first window run waits), and the next comes
        ``_NEXT_TURN`` iterations later."""
        profile = self.profile
        probe = self.probes[profile.probes_made % len(self.probes)]
        index = self.shapes.index(probe)
        first, luckiest = profile.windows_run == 0, self._optimistic_rates()[index]
        if index == self.current or not first and luckiest < rates.max():  # next turn soon
            profile.probes_made, profile.until_probe = profile.probes_made + 1, _NEXT_TURN
            return []
        length = min(_FIRST_PROBE_RUN if first else _PROBE_RUN,
                     self._affordable(luckiest, index, rates))
        if length < _PROBE_RUN:  # too few to learn from: later, when the budget has grown
            profile.probes_made += not first
            profile.until_probe = _NEXT_TURN
            return []
        if first:
            profile.at_risk[:], profile.stopped[:] = 0.0, 0.0
        profile.probes_made, profile.until_probe = profile.probes_made + 1, None
        profile.windows_run += 1
        return [probe] * length

    def _ar_turn_due(self) -> bool:
        """Count one iteration fed with a window towards AR's next timing run; whether it is
        due. AR's turns come every ``_PROBE`` such iterations times the square root of the turns
        so far, whatever the windows' probes cost: AR, not fed, is timed nowhere else, and a
        busy spell that pushed its time up must not keep a window fed that does not pay."""
        profile = self.profile
        if profile.until_ar_turn is None:
            profile.until_ar_turn = int(_PROBE * math.sqrt(profile.ar_turns + 1))
        profile.until_ar_turn -= 1
        return profile.until_ar_turn <= 0

    def _ar_run(self, rates: np.ndarray) -> list[DraftTree]:
        """AR's timing run: ``_AR_PROBE_RUN`` iterations, or none where the learning budget
        does not cover them (the turn then comes ``_NEXT_TURN`` iterations later)."""
        profile = self.profile
        length = min(_AR_PROBE_RUN, self._affordable(rates[0], 0, rates))
        if length < _AR_PROBE_RUN:
            profile.until_ar_turn = _NEXT_TURN
            return []
        profile.ar_turns, profile.until_ar_turn = profile.ar_turns + 1, None
        return [self.shapes[0]] * length

    def _affordable(self, rate: float, index: int, rates: np.ndarray) -> int:
        """How many iterations of shape ``index``, expected to commit ``rate`` codes per second,
        the learning budget still covers in this generation: what learning cost so far, plus
        their charge at that rate, within ``_LEARNING_SHARE`` of the generation's time (so far,
        and the rest of the image at the best rate); none once the budget is spent."""
        budget, charge = self._budget_left(), self._seconds()[index] * (1.0 - rate / rates.max())
        if budget <= 0.0:
            return 0
        return _FIRST_PROBE_RUN if charge <= 0.0 else int(budget / charge)

    def _budget_left(self) -> float:
        """Seconds (passes) learning may still cost in this generation: ``_LEARNING_SHARE`` of
        its time so far and of the rest of the image at the best rate, less what it cost."""
        best = self._best_rate()
        rest = 0.0 if best is None else max(self.image_codes - self.codes_done, 0.0) / best
        return _LEARNING_SHARE * (self.elapsed + rest) - self.learning_cost

    def _longest_hopeful_window(self, rates: np.ndarray) -> int:
        """The longest chain window expected to come within ``_UNDERRATED`` of the best shape
        (the longest window where none is): drafts are counted on it and on any longer window
        fed. Its expected rate, not the luckiest one the counts allow: depths that few drafts
        reached (those of one early run of the longest window) would keep a long window
        hopeful on that luck, and its iterations, which are skipped, the only ones counted."""
        hopeful = (self.levels == 0) & (self.windows > 1) & (
            rates >= (1.0 - _UNDERRATED) * rates.max())
        return int(self.windows[hopeful].max()) if hopeful.any() else self.probes[0].window

    def _optimistic_rates(self) -> np.ndarray:
        """Codes per second of every shape if its drafts were as lucky as the counts allow, at
        its fastest time: each depth's rejections without the pooled rate to lean on (a depth no
        draft reached always passes), and further PD candidates with one pass more than counted
        (before any tree ran, they always pass)."""
        profile = self.profile
        hazard = profile.stopped[1:] / (profile.at_risk[1:] + 1.0)
        sibling_pass = (profile.sibling_passes + 1.0) / (profile.sibling_tests + 1.0)
        return self._codes(hazard, sibling_pass) / self._seconds({**profile.seconds,
                                                                  **profile.fastest})

    def _hazard(self) -> np.ndarray:
        """Rejection rate of the draft at depth j = 1 .. window - 1 (index j - 1), given that the
        ones before it passed. Each depth leans, by one draft's weight, on the rate of all depths
        together: the deep depths, which few drafts reach, are then not pulled towards a fixed
        guess (that would make every window past them look worth less than it is)."""
        stopped, at_risk = self.profile.stopped[1:], self.profile.at_risk[1:]
        pooled = (stopped.sum() + _PRIOR_HAZARD) / (at_risk.sum() + 1.0)
        return (stopped + pooled) / (at_risk + 1.0)

    def _codes(self, hazard: np.ndarray, sibling_pass: float) -> np.ndarray:
        """Expected codes per iteration of every shape (see the class docstring)."""
        committed = np.zeros(len(hazard) + 2)  # [L]: sum of S(j), j < L
        np.cumsum(np.cumprod(1.0 - hazard), out=committed[2:])
        committed[1:] += 1.0
        codes = committed[self.windows]
        depth_hazard = hazard[:self.candidates.shape[1]]
        passes = 1.0 - depth_hazard * (1.0 - sibling_pass) ** self.siblings_of
        reach = np.cumprod(np.where(self.in_tree, passes, 1.0), axis=1)
        return codes + self.is_tree * (1.0 + (reach * self.in_tree).sum(1)
                                       - committed[self.levels + 1])

    def _sibling_pass(self) -> float:
        """``r``: the share of PD candidates 2..K that passed where the ones before them
        failed; until trees have run, 0 (a tree is then expected to add nothing)."""
        return self.profile.sibling_passes / (self.profile.sibling_tests + 1.0)

    def _rates(self) -> np.ndarray:
        """Expected codes per second of every shape."""
        return self._codes(self._hazard(), self._sibling_pass()) / self._seconds()

    def _seconds(self, measured: dict[int, float] | None = None) -> np.ndarray:
        """Seconds per iteration of every shape: a line in fed nodes through the ``measured``
        shapes (by default their usual times), but never less than a shape's own fastest time
        (a short window may cost more than the line says; one timed while the machine was busy
        is not priced out), and plain autoregression's own time; all 1 when the cost is forward
        passes."""
        if self.per_pass:
            return np.ones_like(self.sizes)
        measured = self.profile.seconds if measured is None else measured
        points = [(n, t) for n, t in measured.items() if n > 1]
        if len(points) >= 2:
            slope, intercept = _line(points)
            seconds = np.maximum(intercept + max(slope, 0.0) * self.sizes, 1e-9)
        elif points:
            nodes, time = points[0]
            seconds = time * (1 + self.sizes / nodes) / 2  # until a second size is timed
        else:
            seconds = self.sizes.copy()
        for nodes, fastest in self.profile.fastest.items():
            if nodes > 1:
                seconds[self.sizes == nodes] = np.maximum(seconds[self.sizes == nodes], fastest)
        if 1 in measured:  # plain autoregression's lean step is not on the speculative line
            seconds[self.sizes == 1] = measured[1]
        return seconds

    # ------------------------------------------------------------------ learning
    def observe(self, tree: DraftTree, rows: list[int], accepted: list[int], warm: bool,
                siblings: tuple[int, int], timed: bool = True) -> None:
        self.run = self.run + 1 if tree is self.previous else 1
        self.previous = tree
        # fewer rows: the images that finished cost nothing more, and compile nothing
        full = len(accepted) == self.batch_size
        # compiled, a shape's first feed compiles it in whatever graph torch picks, where the
        # engine may have seen no new graph: its seconds are compiling's, not learning's
        compiling = not timed
        if self.compiles and full:
            index = self.shapes.index(tree)
            compiling = compiling or index not in self.profile.fed
            self.profile.fed.add(index)
        if tree.tree_levels:
            profile = self.profile
            profile.sibling_tests = _MEMORY * profile.sibling_tests + siblings[0]
            profile.sibling_passes = _MEMORY * profile.sibling_passes + siblings[1]
        elif warm and self.run > _SETTLE and tree.window >= self.counted_from:
            self._count(tree, np.asarray(accepted))
        if self.learning and tree.window > 1 and self.run > _SETTLE:  # a probe run counted
            self.profile.cut_short = 0
        codes = sum(accepted) / len(accepted)
        self.codes_done += codes
        if not self.untimed:
            self.pending.append(_Fed(self.iteration, tree.size, not compiling and full
                                     and self.run > _TIMING_SETTLE, compiling, self.learning,
                                     codes))
        self.iteration += 1
        if self.learning or self.rates is None:  # its charge counts against the budget at once
            self._read_times()

    def _read_times(self) -> None:
        """Book the iterations whose seconds the clock has now (:meth:`_book`)."""
        still = []
        for fed in self.pending:
            try:
                seconds = self.seconds_of(fed.iteration)
            except Exception as error:  # a device clock that cannot be read, whatever it raises
                self._stop_timing(fed.iteration, f"{type(error).__name__}: {first_line(error)}")
                return
            if seconds is None:
                still.append(fed)
            elif not (isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
                      and 0.0 < seconds < math.inf):
                self._stop_timing(fed.iteration, f"it measured {quote(seconds)} seconds")
                return
            else:
                self._book(fed, float(seconds))
        self.pending = still

    def _book(self, fed: _Fed, seconds: float) -> None:
        """An iteration's seconds: its shape's time where they price it, the generation's
        time, and, for a learning iteration, its charge: the seconds beyond what the best shape
        expected (AR before any estimate) would have taken to commit its codes. Where the cost
        is forward passes, every iteration costs one."""
        if fed.prices:
            self.profile.time(fed.nodes, seconds)
        if fed.compiling:
            return
        cost = 1.0 if self.per_pass else seconds
        self.elapsed += cost
        best = self._best_rate()
        if fed.learning and best is not None:
            self.learning_cost += cost - fed.codes / best

    def _best_rate(self) -> float | None:
        """The best expected codes per second (per pass); AR's before the first estimate."""
        if self.rates is not None:
            return float(self.rates.max())
        ar = 1.0 if self.per_pass else self.profile.seconds.get(1)
        return None if ar is None else 1.0 / ar

    def _stop_timing(self, iteration: int, reason: str) -> None:
        """Feed the longest window from now on: without times, costs cannot be compared."""
        self.untimed, self.pending = True, []
        self.warnings.append(f"auto could not time iteration {iteration} ({reason}); it fed a "
                             f"fixed {describe_shape(self.probes[0])} from iteration "
                             f"{self.iteration} on")

    def _count(self, tree: DraftTree, counts: np.ndarray) -> None:
        """Drafts tested and rejected per depth of the window."""
        profile = self.profile
        profile.at_risk *= _MEMORY
        profile.stopped *= _MEMORY
        depths = np.arange(profile.window)
        for passed in counts - 1:  # drafts that passed, per row
            tested = min(passed + 1, tree.window - 1)
            profile.at_risk += (depths >= 1) & (depths <= tested)
            if passed + 1 <= tree.window - 1:
                profile.stopped[passed + 1] += 1

    def notes(self) -> dict:
        self._read_times()
        rates = self._rates()
        self.profile.current = self._best(rates)  # where the next generation starts
        return {"auto_best_shape": describe_shape(self.shapes[int(rates.argmax())]),
                "auto_sibling_pass": round(self._sibling_pass(), 4),
                "auto_choice": self._choice(rates)}

    def _choice(self, rates: np.ndarray) -> str:
        """One line: the shape fed at the end and why, and what learning cost."""
        if self.untimed:
            return f"{describe_shape(self.probes[0])}: the clock failed"
        fed = self.shapes[self.current]
        if fed.window == 1:
            other = 1 + int(rates[1:].argmax())
            why = (f"no window paid (best {describe_shape(self.shapes[other])}, "
                   f"{rates[other] / rates[0]:.2f}x AR)")
        else:
            why = f"expected {rates[self.current] / rates[0]:.2f}x AR"
        share = max(self.learning_cost, 0.0) / self.elapsed if self.elapsed > 0 else 0.0
        return f"{describe_shape(fed)}: {why}; learning took {100 * share:.1f}% of the time"


def make_plan(settings: AccelerationSettings, model: ImageTokenModel, request: GenerationRequest,
              sampling: SamplingSettings, device: torch.device,
              seconds_of: Callable[[int], float | None], image_codes: int) -> Plan:
    """The plan for ``settings``: fixed for every mode but ``auto`` (``adaptive_shape``);
    ``image_codes``: codes per image."""
    if settings.adaptive_shape:
        return AutoPlan(settings, model, request, sampling, device, seconds_of, image_codes)
    return FixedPlan(settings, device)
