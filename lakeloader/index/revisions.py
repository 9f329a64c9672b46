"""A run's mixture when its config is edited mid-run: the run follows its mixture so far before
step ``at`` and the edited config's mixture from ``at`` on, as one staged mixture.

Stages already restart their counts at their start step while each dataset's example indices
continue from its total over all earlier stages (:func:`lakeloader.index.mixture.staged_assignment`),
so a run continued at ``at`` is its stages before ``at`` followed by the new mixture's stages from
``at`` on: every step before ``at`` keeps its assignment, each dataset continues its own order
where it stopped, and the new weights are exact from ``at`` (each stage within 2 examples of its
target over every whole-batch prefix). Datasets are matched by name: one the new mixture adds
joins with weight 0 in the earlier stages (it starts at its beginning); one it drops keeps its
total and weight 0 from ``at`` on (it resumes where it stopped should it come back). A run's
datasets keep their order (a batch's ``dataset_ids``), new ones after them. A dataset whose plan
grew during the run (files added) has the sizes of its epochs over the run
(:mod:`lakeloader.index.growth`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lakeloader.contracts.specs import MixtureSpec, Stage
from lakeloader.index.growth import EpochSizes, sizes_from


@dataclasses.dataclass(frozen=True)
class RunMixture:
    """The mixture a run has followed: one staged mixture over every dataset it has drawn from,
    the steps at which its config was revised (the first is 0), and the epochs of each dataset
    whose plan grew during the run."""

    spec: MixtureSpec
    revisions: tuple[int, ...] = (0,)
    growth: tuple[tuple[str, EpochSizes], ...] = ()

    def sizes(self, name: str) -> EpochSizes | None:
        """The epochs of dataset ``name`` if its plan grew during the run (None: it did not)."""
        return dict(self.growth).get(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (exact: floats round-trip through JSON)."""
        spec = self.spec
        found = {"names": list(spec.names), "stages": [[s.start_step, list(s.weights)] for s in spec.stages],
                 "batch_size": spec.batch_size, "stop": spec.stop, "seed": spec.seed,
                 "revisions": list(self.revisions)}
        if self.growth:
            found["growth"] = {name: [list(size) for size in sizes.sizes] for name, sizes in self.growth}
        return found

    @classmethod
    def from_dict(cls, found: dict[str, Any]) -> RunMixture:
        """Inverse of :meth:`to_dict`; ValueError (or KeyError, TypeError) if malformed."""
        stages = tuple(Stage(int(start), [float(w) for w in weights]) for start, weights in found["stages"])
        spec = MixtureSpec(tuple(str(n) for n in found["names"]), stages, int(found["batch_size"]),
                           str(found["stop"]), int(found["seed"]))
        revisions = tuple(int(r) for r in found["revisions"])
        if not revisions or revisions[0] != 0 or list(revisions) != sorted(set(revisions)):
            raise ValueError(f"revision steps must start at 0 and increase, got {list(revisions)}")
        growth = tuple((str(name), sizes_from(sizes)) for name, sizes in found.get("growth", {}).items())
        return cls(spec, revisions, growth)


def continued(run: RunMixture, at: int, new: MixtureSpec) -> RunMixture:
    """``run`` followed before step ``at`` and ``new`` from ``at`` on (see the module). The stage
    of ``new`` in force at ``at`` starts at ``at``; its later stages start where ``new`` says.
    ValueError if the batch size or the seed differ (the steps would mean other rows) or ``at``
    is before the run's last revision."""
    old = run.spec
    if new.batch_size != old.batch_size or new.seed != old.seed:
        raise ValueError(f"the batch size ({old.batch_size} -> {new.batch_size}) and the seed ({old.seed} -> "
                         f"{new.seed}) must stay the same")
    if at < run.revisions[-1]:
        raise ValueError(f"a run revised at step {run.revisions[-1]} cannot be continued at step {at}")
    if at == 0:
        return RunMixture(new)
    names = tuple(old.names) + tuple(n for n in new.names if n not in old.names)
    kept = [s for s in old.stages if s.start_step < at]
    current = max(i for i, s in enumerate(new.stages) if s.start_step <= at)
    later = [Stage(at, new.stages[current].weights), *new.stages[current + 1 :]]
    stages = [Stage(s.start_step, _weights(old.names, s.weights, names)) for s in kept]
    stages += [Stage(s.start_step, _weights(new.names, s.weights, names)) for s in later]
    spec = MixtureSpec(names, tuple(stages), old.batch_size, new.stop, old.seed)
    revisions = run.revisions if at == run.revisions[-1] else (*run.revisions, at)
    return RunMixture(spec, revisions, run.growth)


def _weights(names: Sequence[str], weights: Sequence[float], run_names: Sequence[str]) -> list[float]:
    """``weights`` of ``names`` laid out over ``run_names`` (0 for a dataset not among ``names``)."""
    by_name = dict(zip(names, weights))
    return [by_name.get(name, 0.0) for name in run_names]
