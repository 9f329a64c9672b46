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
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

from lakeloader.index.permutation import derive_key, permute

__all__ = [
    "Stage",
    "TreeNode",
    "batch_assignment",
    "batch_assignments",
    "derive_key",
    "huffman_tree",
    "mixture_counts",
    "quantized_weights",
    "stage_totals",
    "staged_assignment",
    "staged_assignments",
    "stop_step",
]

SCALE_BITS = 40
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


def _check_weights(weights: Sequence[float]) -> tuple[float, ...]:
    try:
        values = tuple(float(w) for w in weights)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"mixture weights must be numbers, got {list(weights)!r}") from exc
    if not values:
        raise ValueError("mixture weights are empty: give at least one dataset weight")
    for i, w in enumerate(values):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"mixture weight {i} is {w!r}; weights must be finite and >= 0")
    if not any(values):
        raise ValueError(f"mixture weights are all zero ({list(values)}); at least one must be > 0")
    return values


@functools.lru_cache(maxsize=256)
def _quantize(values: tuple[float, ...]) -> tuple[int, ...]:
    exact = [Fraction(w) for w in values]
    total = sum(exact)
    # Nearest integer of w / total * 2**40, at least 1 for a positive weight.
    return tuple(max(1, math.floor(w / total * (1 << SCALE_BITS) + Fraction(1, 2))) if w else 0 for w in exact)


def quantized_weights(weights: Sequence[float]) -> tuple[int, ...]:
    """The integer weights the schedule really uses (about ``w_d / sum(w) * 2**40``; zero
    exactly for zero weights, >= 1 for positive ones). Raises ValueError on invalid weights."""
    return _quantize(_check_weights(weights))


@functools.lru_cache(maxsize=256)
def _tree(values: tuple[float, ...]) -> _Tree:
    quanta = _quantize(values)
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
    values = _check_weights(weights)
    tree, quanta = _tree(values), _quantize(values)
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


def _check_batch_size(batch_size: int) -> int:
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


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
    values = _check_weights(weights)
    size = _check_batch_size(batch_size)
    ks = _as_batches(batches)
    if ks.size and int(ks.min()) < -1:
        raise ValueError(f"batch index {int(ks.min())} is negative")
    return _prefix_counts(values, size, ks + 1)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Mixture ``weights`` (one per dataset, same order in every stage) from global batch
    ``start_step`` until the next stage starts."""

    start_step: int
    weights: Sequence[float]

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", _check_weights(self.weights))
        if int(self.start_step) != self.start_step or self.start_step < 0:
            raise ValueError(f"stage start_step must be an integer >= 0, got {self.start_step!r}")


def _check_stages(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    stages = tuple(stages)
    if not stages:
        raise ValueError("a mixture needs at least one stage")
    if stages[0].start_step != 0:
        raise ValueError(f"the first stage must start at step 0, got start_step {stages[0].start_step}")
    starts = [s.start_step for s in stages]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"stage start_step values must strictly increase, got {starts}")
    sizes = {len(s.weights) for s in stages}
    if len(sizes) != 1:
        raise ValueError(f"every stage must weigh the same datasets; got {sorted(sizes)} weights")
    return stages


def stage_totals(stages: Sequence[Stage], batch_size: int, ends: np.ndarray) -> np.ndarray:
    """Examples drawn from each dataset over the first ``m`` global batches, for each ``m`` in
    ``ends`` (``m >= 0``), across all stages: int64 ``[len(ends), D]``, non-decreasing in ``m``,
    rows summing to ``m * batch_size``."""
    stages = _check_stages(stages)
    size = _check_batch_size(batch_size)
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
    size = _check_batch_size(batch_size)
    ks = _as_batches(batches)
    if ks.size and int(ks.min()) < 0:
        raise ValueError(f"batch index {int(ks.min())} is negative")
    totals = stage_totals(stages, size, np.concatenate([ks, ks + 1]))
    return _assign(totals[:ks.size], totals[ks.size:], size, ks, key)


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
    stages = _check_stages(stages)
    size = _check_batch_size(batch_size)
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
