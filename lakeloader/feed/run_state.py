"""A loader's saved state: the next step, the fingerprint and definition of the config that made
the batches, and the mixture the run has followed (every revision of its config it was
continued under). Small JSON: it grows with revisions and datasets, never with steps."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from lakeloader.contracts.errors import LakeloaderError
from lakeloader.index.revisions import RunMixture


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Everything needed to resume: the next step, the fingerprint of what defines batches and,
    for a readable account of what changed and to continue a run under an edited config, that
    definition and the run's mixture (absent from states saved before runs could be continued)."""

    step: int
    fingerprint: str
    definition: dict[str, Any] | None = None
    run: RunMixture | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (for checkpoints)."""
        found: dict[str, Any] = {"step": self.step, "fingerprint": self.fingerprint}
        if self.definition is not None:
            found["definition"] = self.definition
        if self.run is not None:
            found["run"] = self.run.to_dict()
        return found

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LoaderState:
        """Inverse of :meth:`to_dict`; a LakeloaderError naming what is wrong with a damaged state."""
        try:
            run = state.get("run")
            return cls(int(state["step"]), str(state["fingerprint"]), state.get("definition"),
                       None if run is None else RunMixture.from_dict(run))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise LakeloaderError(
                f"loader state is not one Loader.state() saved ({type(error).__name__}: {error}); give the "
                "state dict of the checkpoint as it was saved") from None


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "))


def definition_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What changed from ``saved`` to ``current`` (two loaders' definitions): the changes a run can
    be continued under (its mixture, datasets added or removed) and those it cannot (anything
    that decides a dataset's examples or a batch's shape), each as a readable line."""
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
        if old_data[name] != new_data[name]:
            fixed.append(f"dataset {name!r}: its data (the lake's plan of it: sources, fields, build settings) "
                         "changed; put new files in a dataset of their own and add that to the mixture")
        elif old_templates.get(name) != new_templates.get(name):
            fixed.append(f"dataset {name!r}: its collation (format section, BOS/EOS, tokenizer) changed")
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
