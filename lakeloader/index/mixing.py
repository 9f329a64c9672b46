"""Which dataset and which of its examples fills each position of each global batch (the
config's mixture as index maps; used by the loader, the audit and the build's catalog)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from lakeloader.config import Config
from lakeloader.contracts.errors import ConfigError
from lakeloader.index.concat import cumulative
from lakeloader.index.mixture import Stage, quantized_weights, staged_assignment, stop_step
from lakeloader.index.permutation import derive_key

if TYPE_CHECKING:
    from lakeloader.feed.concat_examples import DatasetExamples


@dataclasses.dataclass(frozen=True)
class Mixer:
    """The mixture of a config: names of the datasets it draws from and their staged weights."""

    names: tuple[str, ...]
    stages: tuple[Stage, ...]
    batch_size: int
    stop: str
    seed: int

    @classmethod
    def from_config(cls, config: Config, example_tokens: Mapping[str, float] | None = None) -> Mixer:
        """The mixer of ``config``; a single dataset needs no ``mixture`` section.

        With ``mixture.unit: tokens`` the weights count non-padding tokens: each is divided by
        the dataset's mean non-padding tokens per example (``example_tokens``, from the catalog
        of the complete lake: see :func:`lakeloader.catalog.sql.example_token_means`).
        """
        mixture = config.mixture
        if mixture is None:
            cls.dataset_names(config)  # one dataset, or a clear error
            name = next(iter(config.datasets))
            return cls((name,), (Stage(0, [1.0]),), config.loader.batch_size, "restart", config.loader.seed)
        stage_weights = mixture.all_weights()
        names = cls.dataset_names(config)
        if mixture.unit == "tokens":
            if example_tokens is None:
                raise ConfigError(
                    "mixture.unit = 'tokens' needs each dataset's mean tokens per example, known once "
                    "the lake is built: open a loader or audit on the built lake, or use unit: examples")
            stage_weights = [{n: w / example_tokens[n] if w > 0 else 0.0 for n, w in weights.items()}
                             for weights in stage_weights]
        starts = [0] if mixture.weights is not None else [s.start_step for s in mixture.stages or []]
        stages = tuple(Stage(start, [w.get(n, 0.0) for n in names]) for start, w in zip(starts, stage_weights))
        return cls(names, stages, config.loader.batch_size, mixture.stop, config.loader.seed)

    @staticmethod
    def dataset_names(config: Config) -> tuple[str, ...]:
        """The datasets the config's mixture draws from (weight > 0 in some stage), in config order."""
        if config.mixture is None:
            if len(config.datasets) != 1:
                raise ConfigError(
                    f"{config.source_file or 'config'}: {len(config.datasets)} datasets need a "
                    "'mixture' section (e.g. mixture: {weights: {" +
                    ", ".join(f"{n}: 1" for n in config.datasets) + "}})")
            return tuple(config.datasets)
        weights = config.mixture.all_weights()
        return tuple(n for n in config.datasets if any(w.get(n, 0) > 0 for w in weights))

    @property
    def mixture_id(self) -> str:
        """The mixture's id in the catalog (table ``mixtures``): a hash of the dataset names, each
        stage's start step and quantised weights, the batch size and the stop strategy."""
        payload = {
            "datasets": list(self.names),
            "stages": [[s.start_step, list(quantized_weights(s.weights))] for s in self.stages],
            "batch_size": self.batch_size,
            "stop": self.stop,
        }
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    @property
    def single(self) -> bool:
        return len(self.names) == 1

    def assign(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number, example index within it) of ``rows`` of global batch ``step`` in
        training."""
        if self.single:
            return np.zeros(len(rows), np.int64), step * self.batch_size + rows
        owners, indices = staged_assignment(list(self.stages), self.batch_size, step,
                                            derive_key(self.seed, "mixture"))
        return np.asarray(owners, np.int64)[rows], np.asarray(indices, np.int64)[rows]

    def stop_step(self, datasets: Sequence[DatasetExamples]) -> int | None:
        """Training batches before the stop strategy ends the stream (None: infinite)."""
        if self.stop == "restart":
            return None
        sizes = [d.train_count() for d in datasets]
        return stop_step(list(self.stages), self.batch_size, sizes, self.stop)

    def eval_total(self, datasets: Sequence[DatasetExamples]) -> int:
        """Examples of an evaluation pass: every dataset once, in config order."""
        return int(sum(d.eval_count() for d in datasets))

    def eval_assign(self, positions: np.ndarray, datasets: Sequence[DatasetExamples]) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number or -1 past the end, example index) of evaluation positions."""
        offsets = cumulative(np.array([d.eval_count() for d in datasets], np.int64))
        owners = np.searchsorted(offsets, positions, side="right") - 1
        past = positions >= offsets[-1]
        owners = np.where(past, -1, owners)
        indices = np.where(past, 0, positions - offsets[np.clip(owners, 0, len(datasets) - 1)])
        return owners.astype(np.int64), indices.astype(np.int64)
