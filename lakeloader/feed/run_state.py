"""A loader's saved state: the next step, the fingerprint and definition of the config that made
the batches, and the mixture the run has followed (every revision of its config it was
continued under). Small JSON: it grows with revisions and datasets, never with steps."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from lakeloader.contracts.errors import LakeloaderError
from lakeloader.index.revisions import RunMixture
from lakeloader.read.catalog_view import CatalogView


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Everything needed to resume: the next step, the fingerprint of what defines batches and,
    for a readable account of what changed and to continue a run under an edited config, that
    definition and the run's mixture (absent from states saved before runs could be continued),
    and the plans of the datasets the run reads that its config's definition leaves out (those
    left out of its mixture)."""

    step: int
    fingerprint: str
    definition: dict[str, Any] | None = None
    run: RunMixture | None = None
    plans: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (for checkpoints)."""
        found: dict[str, Any] = {"step": self.step, "fingerprint": self.fingerprint}
        if self.definition is not None:
            found["definition"] = self.definition
        if self.run is not None:
            found["run"] = self.run.to_dict()
        if self.plans is not None:
            found["plans"] = self.plans
        return found

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LoaderState:
        """Inverse of :meth:`to_dict`; a LakeloaderError naming what is wrong with a damaged state."""
        try:
            run = state.get("run")
            plans = state.get("plans")
            return cls(int(state["step"]), str(state["fingerprint"]), state.get("definition"),
                       None if run is None else RunMixture.from_dict(run),
                       None if plans is None else {str(k): str(v) for k, v in plans.items()})
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise LakeloaderError(
                f"loader state is not one Loader.state() saved ({type(error).__name__}: {error}); give the "
                "state dict of the checkpoint as it was saved") from None


def grown_plans(state: LoaderState, current: dict[str, Any], view: CatalogView) -> dict[str, tuple[int, str]]:
    """The datasets the state's run reads whose plan in the lake of ``view`` grew (files added:
    ``plan/growth.py``) from the one the run read: that plan's chunks and the growth in words.
    A LakeloaderError for one that ``current`` (a loader's definition) leaves out whose plan
    changed otherwise (the steps that read it could not be read as the run saw them; the
    datasets ``current`` defines are compared by :func:`definition_changes`)."""
    saved = {**(state.definition or {}).get("datasets", {}), **(state.plans or {})}
    grown = {}
    for name, older in saved.items():
        found = view.plan_of(name)
        if found is None or found[0] == older:
            continue
        links, plan, chunks = view.plan_growth(name), found[0], None
        while plan != older and plan in links:   # back along the growths, to the state's plan
            plan, chunks = links[plan]
        if plan == older and chunks is not None:
            grown[name] = (chunks, f"its first {chunks} chunks as the run read them, then the added files' chunks")
        elif name not in current["datasets"]:
            raise LakeloaderError(
                f"the run saved at step {state.step} cannot be continued: the lake's plan of dataset {name!r}, "
                "which it drew from, changed other than by files added; restore with the lake the state was "
                "saved with, or start a new run")
    return grown


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "))


def definition_changes(saved: dict[str, Any], current: dict[str, Any],
                       grown: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """What changed from ``saved`` to ``current`` (two loaders' definitions): the changes a run can
    be continued under (its mixture, datasets added or removed, datasets in ``grown``: those
    whose plan in ``current`` is a growth of the one in ``saved``, each with a line saying how)
    and those it cannot (anything that decides a dataset's examples or a batch's shape), each as
    a readable line."""
    grown = grown or {}
    continuable: list[str] = []
    fixed: list[str] = []
    if saved.get("mode") != current.get("mode"):
        fixed.append(f"mode: {saved.get('mode')} -> {current.get('mode')}")
    old_loader, new_loader = saved.get("loader", {}), current.get("loader", {})
    for key in sorted(old_loader.keys() | new_loader.keys()):
        if old_loader.get(key) != new_loader.get(key):
            fixed.append(f"loader.{key}: {_shown(old_loader.get(key))} -> {_shown(new_loader.get(key))}")
    if saved.get("pad") != current.get("pad"):
        fixed.append(f"the padding token's id: {saved.get('pad')} -> {current.get('pad')}")
    old_images, new_images = saved.get("images") or {}, current.get("images") or {}
    if old_images.get("decoder") != new_images.get("decoder"):
        fixed.append(f"the image decoder: {old_images.get('decoder')} -> {new_images.get('decoder')} (stored images' "
                     "pixels may differ)")
    if old_images.get("resolution") != new_images.get("resolution"):
        fixed.append(f"interleaved.resolution: {_shown(old_images.get('resolution'))} -> "
                     f"{_shown(new_images.get('resolution'))}")
    old_data, new_data = saved.get("datasets", {}), current.get("datasets", {})
    old_templates, new_templates = saved.get("templates", {}), current.get("templates", {})
    for name in sorted(old_data.keys() & new_data.keys()):
        if old_data[name] != new_data[name] and name not in grown:
            fixed.append(f"dataset {name!r}: its data (the lake's plan of it: sources, fields, build settings) "
                         "changed other than by files added; put new files in a dataset of their own and add "
                         "that to the mixture")
            continue
        if old_data[name] != new_data[name]:
            continuable.append(f"dataset {name!r} grew: {grown[name]}")
        if old_templates.get(name) != new_templates.get(name):
            fixed.append(f"dataset {name!r}: its collation (format section, BOS/EOS, tokenizer) changed")
    continuable += [f"dataset {name!r} grew: {words}" for name, words in sorted(grown.items())
                    if name not in old_data.keys() & new_data.keys()]   # (read by the run, left out of a mixture)
    added, removed = sorted(new_data.keys() - old_data.keys()), sorted(old_data.keys() - new_data.keys())
    if added:
        continuable.append(f"datasets added: {', '.join(added)}")
    if removed:
        continuable.append(f"datasets removed: {', '.join(removed)}")
    old_mixture, new_mixture = saved.get("mixture") or {}, current.get("mixture") or {}
    for key in sorted(old_mixture.keys() | new_mixture.keys()):
        if old_mixture.get(key) != new_mixture.get(key):
            continuable.append(f"mixture.{key}: {_shown(old_mixture.get(key))} -> {_shown(new_mixture.get(key))}")
    return continuable, fixed
