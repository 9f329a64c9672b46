"""Weighted mixtures of datasets with an exact, closed-form, seekable schedule.

The datasets with positive weight are the leaves of a Huffman tree (repeatedly merge the two
lightest nodes, ties broken by creation order). After ``n`` examples the root has count ``n``;
a node ``p`` with count ``C_p`` gives its first child ``floor(C_p * W_c / W_p + 1/2)`` and its
second child the rest. Every count is monotone in ``n``, the leaves sum to ``n``, and each leaf
stays within 2 of its share: ``|C_d - w_d * n| < 2`` (the rounding error of a child is at most
1/2 plus ``W_c / W_p`` times its parent's, and in a Huffman tree each internal node weighs at
most 2/3 of its parent, so the errors sum to less than ``1/2 * (1 + 1 + 2/3 + 4/9 + ...) = 2``).

Weights are first quantised to integers summing to about ``2**40`` (exact rational rounding,
no float arithmetic), and the splits use only uint64 integer arithmetic, so every count is
bitwise reproducible for prefixes up to ``2**62`` examples.

A mixture's spec (:class:`lakeloader.contracts.specs.MixtureSpec`: datasets, stages of weights,
batch size, stop strategy, seed) becomes index maps in :class:`Mixer`. Every per-step count (what
the loader assigns, what the audit reports, what the catalog's ``mixture_plan`` macro recomputes
in SQL from the rows of :func:`mixture_rows`) comes from one computation, :func:`schedule`.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lakeloader.contracts.specs import (
    MixtureSpec,
    Stage,
    check_batch_size,
    check_stages,
    check_weights,
    quantized_weights,
)
from lakeloader.index.permutation import derive_key, permute
from lakeloader.index.ranges import cumulative

__all__ = [
    "Mixer",
    "MixtureRows",
    "Schedule",
    "Stage",
    "TreeNode",
    "batch_assignment",
    "batch_assignments",
    "derive_key",
    "huffman_tree",
    "mixture_counts",
    "mixture_rows",
    "quantized_weights",
    "schedule",
    "stage_totals",
    "staged_assignment",
    "staged_assignments",
    "stop_step",
]

MAX_EXAMPLES = 1 << 62
_LOW_BITS = 20
_LOW_MASK = np.uint64((1 << _LOW_BITS) - 1)


@dataclasses.dataclass(frozen=True)
class _Split:
    """Node ``parent`` splits its count between ``first`` (rounded share) and ``second``."""

    parent: int
    first: int
    second: int
    parent_weight: int
    first_weight: int


@dataclasses.dataclass(frozen=True)
class _Tree:
    num_datasets: int
    leaves: tuple[int, ...]          # dataset number of each leaf node (leaf node i = i-th positive)
    root: int
    splits: tuple[_Split, ...]       # top-down: a parent's split comes before its children's


@functools.lru_cache(maxsize=256)
def _tree(values: tuple[float, ...]) -> _Tree:
    quanta = quantized_weights(values)
    leaves = tuple(d for d, q in enumerate(quanta) if q)
    heap = [(quanta[d], node) for node, d in enumerate(leaves)]
    heapq.heapify(heap)
    splits = []
    node = len(leaves)
    while len(heap) > 1:
        w1, n1 = heapq.heappop(heap)
        w2, n2 = heapq.heappop(heap)
        splits.append(_Split(node, n1, n2, w1 + w2, w1))
        heapq.heappush(heap, (w1 + w2, node))
        node += 1
    return _Tree(len(values), leaves, heap[0][1], tuple(reversed(splits)))


@dataclasses.dataclass(frozen=True)
class TreeNode:
    """One node of the Huffman tree that :func:`mixture_counts` evaluates.

    The root (``parent is None``) holds all ``n`` examples. A node with count ``C`` gives its
    first child ``floor((2 * first_weight * C + weight) / (2 * weight))`` and its second child
    the rest, so a child's count is computed from its parent's with ``split_weight`` (the weight
    of the parent's first child) and ``parent_weight``. Leaves carry their dataset number.
    """

    node: int
    parent: int | None
    first: bool                 # the parent's first child (rounded share) or its second (the rest); root: True
    weight: int                 # quantised weight: the sum of the leaves below
    parent_weight: int | None
    split_weight: int | None    # weight of the parent's first child
    dataset: int | None         # dataset number of a leaf, None for an internal node
    depth: int


def huffman_tree(weights: Sequence[float]) -> tuple[TreeNode, ...]:
    """The nodes of the schedule's Huffman tree for ``weights``, top-down (root first, a parent
    before its children), with the exact integer weights :func:`mixture_counts` uses. Zero
    weights have no leaf. Raises ValueError on invalid weights."""
    values = check_weights(weights)
    tree, quanta = _tree(values), quantized_weights(values)
    weight = {node: quanta[d] for node, d in enumerate(tree.leaves)}
    for split in reversed(tree.splits):  # bottom-up: children before parents
        weight[split.parent] = split.parent_weight
    nodes = [TreeNode(tree.root, None, True, weight[tree.root], None, None,
                      tree.leaves[tree.root] if tree.root < len(tree.leaves) else None, 0)]
    depth = {tree.root: 0}
    for split in tree.splits:
        for child, first in ((split.first, True), (split.second, False)):
            depth[child] = depth[split.parent] + 1
            dataset = tree.leaves[child] if child < len(tree.leaves) else None
            nodes.append(TreeNode(child, split.parent, first, weight[child], split.parent_weight,
                                  split.first_weight, dataset, depth[child]))
    return tuple(nodes)


def _first_share(parent: np.ndarray, first_weight: int, parent_weight: int) -> np.ndarray:
    """``floor((2 * Wc * C + Wp) / (2 * Wp))`` exactly, for uint64 ``C < 2**62``, ``Wp < 2**41``.

    With ``C = q*Wp + r`` and ``r = r_hi * 2**20 + r_lo`` every intermediate stays below 2**64.
    """
    wc, wp = np.uint64(first_weight), np.uint64(parent_weight)
    q, r = parent // wp, parent % wp
    a = wc * (r >> np.uint64(_LOW_BITS))
    a1, a0 = a // wp, a % wp
    tail = (a0 << np.uint64(_LOW_BITS + 1)) + np.uint64(2) * wc * (r & _LOW_MASK) + wp
    return wc * q + (a1 << np.uint64(_LOW_BITS)) + tail // (np.uint64(2) * wp)


def _leaf_counts(tree: _Tree, totals: np.ndarray) -> np.ndarray:
    """Counts ``[len(totals), D]`` of each dataset after ``totals`` examples (uint64 in)."""
    counts: dict[int, np.ndarray] = {tree.root: totals}
    for split in tree.splits:
        parent = counts.pop(split.parent)
        first = _first_share(parent, split.first_weight, split.parent_weight)
        counts[split.first] = first
        counts[split.second] = parent - first
    out = np.zeros((totals.size, tree.num_datasets), dtype=np.int64)
    for node, d in enumerate(tree.leaves):
        out[:, d] = counts[node]
    return out


def _as_batches(batches: np.ndarray | Sequence[int] | int) -> np.ndarray:
    array = np.asarray(batches)
    if array.dtype.kind not in "iu" and not (array.size == 0 and array.dtype.kind == "f"):
        raise TypeError(f"batch indices must be integers, got dtype {array.dtype}")
    return array.astype(np.int64).reshape(-1)


def _prefix_counts(values: tuple[float, ...], batch_size: int, ends: np.ndarray) -> np.ndarray:
    """Counts after ``ends`` whole batches (``ends >= 0``), shape ``[len(ends), D]``."""
    if ends.size and int(ends.max()) > MAX_EXAMPLES // batch_size:
        raise ValueError(f"batch {int(ends.max()) - 1} is past the supported {MAX_EXAMPLES} examples")
    return _leaf_counts(_tree(values), ends.astype(np.uint64) * np.uint64(batch_size))


def mixture_counts(weights: Sequence[float], batch_size: int, batches: np.ndarray) -> np.ndarray:
    """Cumulative examples drawn from each dataset by the end of each batch ``k`` in ``batches``
    (after ``(k+1) * batch_size`` examples), int64 of shape ``[len(batches), len(weights)]``.

    Promises: rows sum to ``(k+1) * batch_size``; every column is non-decreasing in ``k``;
    ``|C_d - w_d * n| < 2`` for the (quantised, normalised) weights; zero weights give 0.
    ``k = -1`` is allowed (all zeros). Raises ValueError for negative, NaN, infinite or
    all-zero weights and for ``k < -1``.
    """
    values = check_weights(weights)
    size = check_batch_size(batch_size)
    ks = _as_batches(batches)
    if ks.size and int(ks.min()) < -1:
        raise ValueError(f"batch index {int(ks.min())} is negative")
    return _prefix_counts(values, size, ks + 1)


def stage_totals(stages: Sequence[Stage], batch_size: int, ends: np.ndarray) -> np.ndarray:
    """Examples drawn from each dataset over the first ``m`` global batches, for each ``m`` in
    ``ends`` (``m >= 0``), across all stages: int64 ``[len(ends), D]``, non-decreasing in ``m``,
    rows summing to ``m * batch_size``."""
    stages = check_stages(stages)
    size = check_batch_size(batch_size)
    ms = _as_batches(ends)
    if ms.size and int(ms.min()) < 0:
        raise ValueError(f"batch count {int(ms.min())} is negative")
    out = np.zeros((ms.size, len(stages[0].weights)), dtype=np.int64)
    bounds = [s.start_step for s in stages[1:]] + [None]
    for stage, stop in zip(stages, bounds):
        done = ms - stage.start_step
        if stop is not None:
            done = np.minimum(done, stop - stage.start_step)
        out += _prefix_counts(stage.weights, size, np.maximum(done, 0))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A staged mixture's counts at global steps ``steps`` (arrays ``[len(steps), D]`` unless
    said otherwise): what the loader assigns, the audit reports and the catalog's ``mixture_plan``
    macro recomputes, bit for bit. Stream indices continue across stages; counts from the start
    of a step's stage restart at each ``start_step``."""

    stages: tuple[Stage, ...]
    batch_size: int
    steps: np.ndarray    # int64 [K]
    stage: np.ndarray    # int64 [K]: the stage of each step
    before: np.ndarray   # examples of each dataset drawn by the batches before the step
    after: np.ndarray    # ... and by the end of the step: the step drew indices [before, after)

    @functools.cached_property
    def base(self) -> np.ndarray:
        """Examples of each dataset drawn by the stages before the step's stage."""
        starts = np.array([s.start_step for s in self.stages], np.int64)
        return stage_totals(self.stages, self.batch_size, starts)[self.stage]

    @functools.cached_property
    def stage_before(self) -> np.ndarray:
        """The dataset's examples from the start of the step's stage to the step (excluded)."""
        return self.before - self.base

    @functools.cached_property
    def stage_after(self) -> np.ndarray:
        """The dataset's examples from the start of the step's stage to the step (included)."""
        return self.after - self.base

    @functools.cached_property
    def stage_examples(self) -> np.ndarray:
        """Examples of the step's stage by the end of the step, int64 ``[K]``."""
        starts = np.array([s.start_step for s in self.stages], np.int64)
        return (self.steps - starts[self.stage] + 1) * self.batch_size

    @functools.cached_property
    def _quanta(self) -> tuple[np.ndarray, np.ndarray]:
        quanta = np.array([quantized_weights(s.weights) for s in self.stages], np.int64)
        return quanta[self.stage], quanta.sum(axis=1)[self.stage][:, None]

    @functools.cached_property
    def target_weight(self) -> np.ndarray:
        """The step's stage's (quantised) weight of each dataset."""
        quanta, total = self._quanta
        return quanta / total

    @functools.cached_property
    def deviation(self) -> np.ndarray:
        """``|stage_after - target_weight * stage_examples|``: below 2 at every step."""
        quanta, total = self._quanta
        # |C*W - q*n| < 2W < 2**63, so wrapping uint64 arithmetic gives it exactly.
        numerator = (self.stage_after.astype(np.uint64) * total.astype(np.uint64)
                     - quanta.astype(np.uint64) * self.stage_examples.astype(np.uint64)[:, None]).view(np.int64)
        return np.abs(numerator) / total


def schedule(stages: Sequence[Stage], batch_size: int, steps: np.ndarray | Sequence[int] | int) -> Schedule:
    """The counts of the staged mixture at global ``steps`` (integers >= 0): the one computation
    behind :func:`staged_assignments` (the loader's batches), the audit and the catalog's plan."""
    size = check_batch_size(batch_size)
    ks = _as_batches(steps)
    if ks.size and int(ks.min()) < 0:
        raise ValueError(f"batch index {int(ks.min())} is negative")
    stages = check_stages(stages)
    totals = stage_totals(stages, size, np.concatenate([ks, ks + 1]))
    starts = np.array([s.start_step for s in stages], np.int64)
    stage = np.searchsorted(starts, ks, side="right") - 1
    return Schedule(stages, size, ks, stage, totals[:ks.size], totals[ks.size:])


def _assign(before: np.ndarray, after: np.ndarray, batch_size: int, batches: np.ndarray,
            key: int) -> tuple[np.ndarray, np.ndarray]:
    """Owners and indices ``[K, B]`` of batches whose per-dataset totals go from ``before`` to
    ``after`` (``[K, D]``); labels are shuffled within each batch by its own permutation."""
    k, d = before.shape
    b = batch_size
    per_batch = after - before
    if k == 0:
        return np.zeros((0, b), np.int64), np.zeros((0, b), np.int64)
    keys = np.array([derive_key(key, int(x)) for x in batches], dtype=np.uint64)
    slots = permute(np.broadcast_to(np.arange(b, dtype=np.int64), (k, b)), b, keys[:, None])
    # Dataset of each (row, slot) when slots are laid out dataset by dataset: one searchsorted
    # over the starts of all rows at once (row r's starts are offset by r*B, hence sorted).
    row_base = np.arange(k, dtype=np.int64)[:, None] * b
    starts = (np.cumsum(per_batch, axis=1) - per_batch + row_base).reshape(-1)
    flat = np.searchsorted(starts, (slots + row_base).reshape(-1), side="right") - 1
    owners = flat.reshape(k, b) - np.arange(k, dtype=np.int64)[:, None] * d
    # Rank of each position among its dataset's positions in the batch, in position order.
    group = (owners + np.arange(k, dtype=np.int64)[:, None] * d).reshape(-1)
    order = np.argsort(group, kind="stable")
    group_start = (np.cumsum(per_batch) - per_batch.reshape(-1))
    rank = np.empty(k * b, dtype=np.int64)
    rank[order] = np.arange(k * b, dtype=np.int64) - group_start[group[order]]
    indices = before.reshape(-1)[group] + rank
    return owners, indices.reshape(k, b)


def staged_assignments(stages: Sequence[Stage], batch_size: int, batches: np.ndarray,
                       key: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :func:`staged_assignment`: int64 arrays ``[len(batches), batch_size]``."""
    counts = schedule(stages, batch_size, batches)
    return _assign(counts.before, counts.after, counts.batch_size, counts.steps, key)


def staged_assignment(stages: Sequence[Stage], batch_size: int, batch: int,
                      key: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset number, example index within that dataset) of each position of global batch
    ``batch`` under staged weights, each an int64 array of ``batch_size``.

    A stage's counts restart at its ``start_step`` (its batch ``batch - start_step`` is drawn
    with its own weights), and each dataset's example indices continue from its total over all
    earlier stages, so every dataset's indices over consecutive batches run 0, 1, 2, ... with
    no gap or repeat. Positions within a batch are shuffled by ``permute`` keyed with
    ``derive_key(key, batch)``; a dataset's indices increase in position order. Raises
    ValueError unless the first stage starts at 0 and start steps strictly increase.
    """
    owners, indices = staged_assignments(stages, batch_size, np.array([batch], np.int64), key)
    return owners[0], indices[0]


def batch_assignments(weights: Sequence[float], batch_size: int, batches: np.ndarray,
                      key: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized :func:`batch_assignment`: int64 arrays ``[len(batches), batch_size]``."""
    return staged_assignments([Stage(0, weights)], batch_size, batches, key)


def batch_assignment(weights: Sequence[float], batch_size: int, batch: int,
                     key: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset number, example index within that dataset) of positions ``0..B-1`` of batch
    ``batch`` of a single-stage mixture.

    Dataset ``d`` fills ``C_d(batch) - C_d(batch - 1)`` positions (see :func:`mixture_counts`),
    scattered by ``permute`` keyed with ``derive_key(key, batch)``; its indices are
    ``C_d(batch - 1), C_d(batch - 1) + 1, ...`` in position order, so consecutive batches use
    each dataset's examples 0, 1, 2, ... exactly once.
    """
    return staged_assignment([Stage(0, weights)], batch_size, batch, key)


def stop_step(stages: Sequence[Stage], batch_size: int, sizes: Sequence[int], strategy: str) -> int | None:
    """Number of whole global batches the stream yields before ``strategy`` stops it.

    ``sizes[d]`` is ``N_d``, the examples in one epoch of dataset ``d``.

    - ``"restart"``: None (infinite). Callers read example ``i % N_d`` of epoch ``i // N_d``.
    - ``"first_exhausted"``: the largest ``m`` such that batches ``0..m-1`` draw at most
      ``N_d`` examples of every dataset, i.e. the stream stops right before the first batch
      that would need some dataset's ``(N_d+1)``-th example (so no example repeats).
    - ``"all_exhausted"``: the smallest ``m`` such that batches ``0..m-1`` have drawn at least
      ``N_d`` examples of every dataset whose weight is positive in the last stage (the others
      stop being drawn and are not waited for); datasets already exhausted keep cycling
      (index ``i % N_d``) until then.

    Both are found by binary search over the monotone closed-form totals.
    """
    stages = check_stages(stages)
    size = check_batch_size(batch_size)
    if strategy == "restart":
        return None
    need = np.asarray([int(n) for n in sizes], dtype=np.int64)
    if need.shape != (len(stages[0].weights),):
        raise ValueError(f"got {need.size} dataset sizes for {len(stages[0].weights)} mixture weights")
    if need.size and int(need.min()) < 0:
        raise ValueError(f"dataset sizes must be >= 0, got {need.tolist()}")
    if strategy == "first_exhausted":
        def done(m: int) -> bool:  # batches 0..m-1 overdraw some dataset
            return bool((stage_totals(stages, size, np.array([m]))[0] > need).any())
        return _smallest(done, size) - 1
    if strategy == "all_exhausted":
        final = np.asarray(stages[-1].weights) > 0

        def done(m: int) -> bool:
            return bool((stage_totals(stages, size, np.array([m]))[0][final] >= need[final]).all())
        return _smallest(done, size)
    raise ValueError(f"unknown stop strategy {strategy!r}; use 'restart', 'first_exhausted' or 'all_exhausted'")


def _smallest(done: Callable[[int], bool], batch_size: int) -> int:
    """Smallest ``m >= 0`` with ``done(m)``, for a monotone ``done`` that is eventually true."""
    if done(0):
        return 0
    limit = MAX_EXAMPLES // batch_size
    lo, hi = 0, 1
    while not done(hi):  # done(lo) is false
        lo, hi = hi, hi * 2
        if hi > limit:
            raise ValueError(f"the stop strategy never triggers within {MAX_EXAMPLES} examples")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if done(mid):
            hi = mid
        else:
            lo = mid
    return hi


class Mixer(MixtureSpec):
    """The index maps of a :class:`MixtureSpec`: which dataset and which of its examples fills
    each position of each global batch (training), the stop step, and the evaluation order."""

    @classmethod
    def of(cls, spec: MixtureSpec) -> Mixer:
        """The mixer of ``spec``."""
        if isinstance(spec, cls):
            return spec
        return cls(spec.names, spec.stages, spec.batch_size, spec.stop, spec.seed)

    def schedule(self, steps: np.ndarray | Sequence[int]) -> Schedule:
        """The mixture's counts at global ``steps`` (:func:`schedule`)."""
        return schedule(self.stages, self.batch_size, steps)

    def assign(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number, example index within it) of ``rows`` of global batch ``step`` in
        training."""
        if self.single:
            return np.zeros(len(rows), np.int64), step * self.batch_size + rows
        owners, indices = staged_assignment(list(self.stages), self.batch_size, step,
                                            derive_key(self.seed, "mixture"))
        return np.asarray(owners, np.int64)[rows], np.asarray(indices, np.int64)[rows]

    @property
    def finite(self) -> bool:
        """Whether the stop strategy ends the training stream (else it cycles forever)."""
        return self.stop != "restart"

    def stop_step(self, train_counts: Sequence[int]) -> int | None:
        """Training batches before the stop strategy ends the stream (None: infinite), for
        datasets of ``train_counts`` examples per epoch (in ``names`` order)."""
        if not self.finite:
            return None
        return stop_step(list(self.stages), self.batch_size, train_counts, self.stop)

    def eval_total(self, eval_counts: Sequence[int]) -> int:
        """Examples of an evaluation pass over datasets of ``eval_counts`` examples: every
        dataset once, in ``names`` order."""
        return int(sum(eval_counts))

    def eval_assign(self, positions: np.ndarray,
                    eval_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number or -1 past the end, example index) of evaluation ``positions``."""
        offsets = cumulative(np.asarray(eval_counts, np.int64))
        owners = np.searchsorted(offsets, positions, side="right") - 1
        past = positions >= offsets[-1]
        owners = np.where(past, -1, owners)
        indices = np.where(past, 0, positions - offsets[np.clip(owners, 0, len(eval_counts) - 1)])
        return owners.astype(np.int64), indices.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class MixtureRows:
    """A mixture's rows for the catalog tables ``mixtures``, ``mixture_stages`` and
    ``mixture_nodes`` (keys are their columns): what the ``mixture_plan`` macro computes from."""

    mixture: dict[str, Any]
    stages: list[dict[str, Any]]
    nodes: list[dict[str, Any]]


def mixture_rows(spec: MixtureSpec) -> MixtureRows:
    """The catalog rows of ``spec``: each stage's steps, weights and quantised weights, and the
    Huffman tree of each stage with the exact integers :func:`schedule` splits counts by."""
    mixture_id = spec.mixture_id
    stages, nodes = [], []
    ends = [s.start_step for s in spec.stages[1:]] + [None]
    for number, (stage, end) in enumerate(zip(spec.stages, ends)):
        quanta = quantized_weights(stage.weights)
        stages.append({"mixture_id": mixture_id, "stage": number, "start_step": stage.start_step,
                       "end_step": end, "weights": list(stage.weights), "quanta": list(quanta),
                       "total_weight": sum(quanta)})
        nodes += [{"mixture_id": mixture_id, "stage": number, "node": node.node, "parent": node.parent,
                   "is_first": node.first, "weight": node.weight, "parent_weight": node.parent_weight,
                   "split_weight": node.split_weight, "dataset": node.dataset, "depth": node.depth}
                  for node in huffman_tree(stage.weights)]
    mixture = {"mixture_id": mixture_id, "batch_size": spec.batch_size, "stop": spec.stop,
               "datasets": list(spec.names), "num_stages": len(spec.stages)}
    return MixtureRows(mixture, stages, nodes)
