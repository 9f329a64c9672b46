"""From a dataset's config to its collation template and packing spec (token ids of the lake's
tokenizer), shared by the build (per-chunk packing counts) and the loader (rendering)."""

from __future__ import annotations

from typing import Any

from lakeloader.config import Config
from lakeloader.contracts.errors import ConfigError
from lakeloader.index.layout import PackingSpec
from lakeloader.index.mixing import Mixer
from lakeloader.index.permutation import derive_key
from lakeloader.index.render import Fim, Template, make_template


def token_id(tokenizer: Any, key: str, token: str) -> int:
    """Id of special token ``token`` named by config key ``key`` (a clear error if unknown)."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ConfigError(f"{key} = {token!r} is not a token of the lake's tokenizer; set {key} to one of "
                          "its special tokens")
    return int(found)


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids) if text else []


def template_for(name: str, config: Config, tokenizer: Any) -> Template:
    """The collation template of dataset ``name``: BOS/EOS from ``loader``, the rest from the
    format's section (chat roles' prefix and suffix, supervised separators, FIM sentinels, image
    runs)."""
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
    return make_template(kinds, bos=bos, eos=eos, fim=fim)


def packing_spec(name: str, config: Config, template: Template) -> PackingSpec | None:
    """The packing spec of dataset ``name`` under ``config.loader`` (None for ``concat``)."""
    loader = config.loader
    if loader.packing == "concat":
        return None
    dataset = config.datasets[name]
    max_images = None
    if dataset.format == "interleaved":
        max_images = dataset.interleaved.max_images
        run = dataset.interleaved.image_tokens + 2
        if run > loader.seq_len:
            raise ConfigError(
                f"datasets.{name}.interleaved.image_tokens = {dataset.interleaved.image_tokens}: an image "
                f"takes {run} tokens with its boundary tokens, more than loader.seq_len = {loader.seq_len}; "
                "an image is never split, so lower image_tokens or raise seq_len")
    return PackingSpec(seq_len=loader.seq_len, mode=loader.packing, algorithm=loader.pack.algorithm,
                       window=loader.pack.window, long_documents=loader.pack.long_documents,
                       template=template, max_images=max_images)


def packing_specs(config: Config, tokenizer: Any) -> dict[str, PackingSpec]:
    """The packing spec of every dataset the config's mixture draws from (none under concat)."""
    if config.loader.packing == "concat":
        return {}
    specs = {name: packing_spec(name, config, template_for(name, config, tokenizer))
             for name in Mixer.dataset_names(config)}
    return {name: spec for name, spec in specs.items() if spec is not None}
