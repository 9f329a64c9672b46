"""From a config to the plain specs the index maps take (:mod:`lakeloader.contracts.specs`), in one
place: the datasets a mixture draws from, its :class:`MixtureSpec` (weights in tokens converted
here), each dataset's collation :class:`Template` (token ids of the lake's tokenizer) and its
:class:`PackingSpec`. Shared by the build (catalog registration, per-chunk packing counts), the
loader (rendering, mixing) and the audit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lakeloader.config import Config, DatasetConfig, MixtureConfig, load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.contracts.specs import (
    Fim,
    ImageResolution,
    ImageRun,
    Infill,
    MixtureSpec,
    PackingSpec,
    Stage,
    Template,
    derive_key,
    make_template,
)


def dataset_names(config: Config | str | os.PathLike[str]) -> tuple[str, ...]:
    """The datasets the config's mixture draws from (weight > 0 in some stage), in config order:
    what a batch's ``dataset_ids`` number. A config without a ``mixture`` section must have
    exactly one dataset (else a ConfigError). ``config``: a Config or its YAML file."""
    config = load_config(config)
    if config.mixture is None:
        if len(config.datasets) != 1:
            raise ConfigError(
                f"{config.source_file or 'config'}: {len(config.datasets)} datasets need a "
                "'mixture' section (e.g. mixture: {weights: {" +
                ", ".join(f"{n}: 1" for n in config.datasets) + "}})")
        return tuple(config.datasets)
    weights = config.mixture.all_weights()
    return tuple(n for n in config.datasets if any(w.get(n, 0) > 0 for w in weights))


def evaluation_config(config: Config) -> Config:
    """The config an evaluation loader reads: with an ``evaluation`` section, its datasets (in its
    order, one weight each: the mixture's dataset list of the pass) and its batch size and
    seq_len where given; without one, ``config`` itself (a pass over the mixture's datasets)."""
    evaluation = config.evaluation
    if evaluation is None:
        return config
    loader = config.loader.model_copy(update={"batch_size": evaluation.batch_size or config.loader.batch_size,
                                              "seq_len": evaluation.seq_len or config.loader.seq_len})
    ordered = {name: config.datasets[name] for name in evaluation.datasets}
    datasets = {**ordered, **{n: d for n, d in config.datasets.items() if n not in ordered}}
    mixture = MixtureConfig(weights={name: 1.0 for name in evaluation.datasets})
    return config.model_copy(update={"loader": loader, "datasets": datasets, "mixture": mixture})


def token_weights(config: Config) -> bool:
    """Whether the config's mixture weighs datasets by tokens (``mixture.unit: tokens``): its spec
    then needs each dataset's mean non-padding tokens per example, known once the lake is built."""
    return config.mixture is not None and config.mixture.unit == "tokens"


def mixture_spec(config: Config, example_tokens: Mapping[str, float] | None = None) -> MixtureSpec:
    """The mixture of ``config``; a single dataset needs no ``mixture`` section.

    With ``mixture.unit: tokens`` the weights count non-padding tokens: each is divided here by
    the dataset's mean non-padding tokens per example (``example_tokens``, from the catalog of the
    complete lake: :func:`lakeloader.catalog.sql.example_token_means`), a ConfigError if missing.
    Under ``unit: examples`` ``example_tokens`` is ignored.
    """
    mixture = config.mixture
    names = dataset_names(config)
    if mixture is None:
        return MixtureSpec(names, (Stage(0, [1.0]),), config.loader.batch_size, "restart", config.loader.seed)
    stage_weights = mixture.all_weights()
    if mixture.unit == "tokens":
        if example_tokens is None:
            raise ConfigError(
                "mixture.unit = 'tokens' needs each dataset's mean tokens per example, known once "
                "the lake is built: open a loader or audit on the built lake, or use unit: examples")
        stage_weights = [{n: w / example_tokens[n] if w > 0 else 0.0 for n, w in weights.items()}
                         for weights in stage_weights]
    starts = [0] if mixture.weights is not None else [s.start_step for s in mixture.stages or []]
    stages = tuple(Stage(start, [w.get(n, 0.0) for n in names]) for start, w in zip(starts, stage_weights))
    return MixtureSpec(names, stages, config.loader.batch_size, mixture.stop, config.loader.seed)


def token_id(tokenizer: Any, key: str, token: str) -> int:
    """Id of special token ``token`` named by config key ``key`` (a clear error if unknown)."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ConfigError(f"{key} = {token!r} is not a token of the lake's tokenizer; set {key} to one of "
                          "its special tokens")
    return int(found)


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids) if text else []


def image_resolution(dataset: DatasetConfig) -> ImageResolution:
    """The :class:`ImageResolution` of an interleaved dataset's ``interleaved.resolution``."""
    r = dataset.interleaved.resolution
    return ImageResolution(r.kind, (r.size[0], r.size[1]), r.patch_size, r.min_pixels, r.max_pixels, r.max_patches)


def stores_images(dataset: DatasetConfig) -> bool:
    """Whether a dataset's images are stored in the lake (their pixels then go in the batch)."""
    return dataset.format == "interleaved" and dataset.interleaved.images == "stored"


def image_run_tokens(dataset: DatasetConfig) -> int:
    """The most placeholder tokens an image of an interleaved dataset takes."""
    resolution = image_resolution(dataset)
    return dataset.interleaved.image_tokens if resolution.kind == "fixed" else resolution.patch_cap


def template_for(name: str, config: Config, tokenizer: Any) -> Template:
    """The collation template of dataset ``name``: BOS/EOS from ``loader``, the rest from the
    format's section (chat roles' prefix and suffix, supervised separators, FIM sentinels,
    infilling's special tokens, image runs)."""
    dataset, loader = config.datasets[name], config.loader
    eos = token_id(tokenizer, "loader.eos_token", loader.eos_token)
    bos = token_id(tokenizer, "loader.bos_token", loader.bos_token) if loader.bos_token else None
    kinds = dataset.part_kinds
    where = f"datasets.{name}"
    if dataset.format == "chat":
        chat = dataset.chat
        return make_template(
            kinds, bos=bos, eos=eos,
            part_prefix={role: _text_ids(tokenizer, t.prefix) for role, t in chat.role_templates.items()},
            part_suffix={role: _text_ids(tokenizer, t.suffix) for role, t in chat.role_templates.items()},
            trains=set(chat.loss_roles))
    if dataset.format == "supervised":
        sup = dataset.supervised
        return make_template(
            kinds, bos=bos, eos=eos, part_prefix={"prompt": _text_ids(tokenizer, sup.prompt_prefix)},
            part_suffix={"prompt": _text_ids(tokenizer, sup.separator),
                         "response": _text_ids(tokenizer, sup.response_suffix)},
            trains={"response"})
    if dataset.format == "interleaved":
        items = dataset.interleaved
        image = token_id(tokenizer, f"{where}.interleaved.image_token", items.image_token)
        start = token_id(tokenizer, f"{where}.interleaved.image_start", items.image_start)
        end = token_id(tokenizer, f"{where}.interleaved.image_end", items.image_end)
        resolution = image_resolution(dataset)
        if resolution.kind == "patches":   # a run of the image's own length, from its stored size
            return make_template(kinds, bos=bos, eos=eos, part_prefix={"image": [start]}, part_suffix={"image": [end]},
                                 trains={"text"}, image_kind="image", image_run=ImageRun(image, resolution))
        return make_template(kinds, bos=bos, eos=eos, part_prefix={"image": [start] + [image] * items.image_tokens},
                             part_suffix={"image": [end]}, trains={"text"}, image_kind="image")
    fim = None
    if dataset.format == "fim":
        f = dataset.fim
        fim = Fim(rate=f.rate, spm_rate=f.spm_rate,
                  prefix=token_id(tokenizer, f"{where}.fim.prefix_token", f.prefix_token),
                  middle=token_id(tokenizer, f"{where}.fim.middle_token", f.middle_token),
                  suffix=token_id(tokenizer, f"{where}.fim.suffix_token", f.suffix_token),
                  key=derive_key(loader.seed, "fim", name))
    infill = None
    if dataset.format == "infill":
        i = dataset.infill

        def optional(key: str, token: str | None) -> int | None:
            return None if token is None else token_id(tokenizer, f"{where}.infill.{key}", token)

        infill = Infill(rate=i.rate, gaps=(i.gaps[0], i.gaps[1]), gap_tokens=(i.gap_tokens[0], i.gap_tokens[1]),
                        mask=token_id(tokenizer, f"{where}.infill.mask_token", i.mask_token),
                        sep=optional("sep_token", i.sep_token), start=optional("start_token", i.start_token),
                        end=token_id(tokenizer, f"{where}.infill.end_token", i.end_token),
                        cls=optional("cls_token", i.cls_token), cls_each=i.cls_position == "each_target",
                        key=derive_key(loader.seed, "infill", name))
    return make_template(kinds, bos=bos, eos=eos, fim=fim, infill=infill)


def packing_spec(name: str, config: Config, template: Template) -> PackingSpec | None:
    """The packing spec of dataset ``name`` under ``config.loader`` (None for ``concat``)."""
    loader = config.loader
    if loader.packing == "concat":
        return None
    dataset = config.datasets[name]
    max_images = None
    if dataset.format == "interleaved":
        max_images = dataset.interleaved.max_images
        run = image_run_tokens(dataset) + 2
        if run > loader.seq_len:
            key = "image_tokens" if image_resolution(dataset).kind == "fixed" else "resolution.max_patches"
            raise ConfigError(
                f"datasets.{name}.interleaved.{key} = {run - 2}: an image "
                f"takes up to {run} tokens with its boundary tokens, more than loader.seq_len = {loader.seq_len}; "
                f"an image is never split, so lower {key} or raise seq_len")
    return PackingSpec(seq_len=loader.seq_len, mode=loader.packing, algorithm=loader.pack.algorithm,
                       open_examples=loader.pack.open_examples, long_documents=loader.pack.long_documents,
                       template=template, max_images=max_images)


def packing_specs(config: Config, tokenizer: Any) -> dict[str, PackingSpec]:
    """The packing spec of every dataset the config's mixture draws from (none under concat)."""
    if config.loader.packing == "concat":
        return {}
    specs = {name: packing_spec(name, config, template_for(name, config, tokenizer))
             for name in dataset_names(config)}
    return {name: spec for name, spec in specs.items() if spec is not None}


def plan_keys(config: Config, specs: Mapping[str, PackingSpec]) -> dict[str, str | None]:
    """The packing plan (``plan_key``) of every dataset the mixture draws from, None under concat:
    what :func:`lakeloader.catalog.sql.example_token_means` reads the counts of."""
    return {name: spec.plan_key if (spec := specs.get(name)) else None for name in dataset_names(config)}
