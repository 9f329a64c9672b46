"""The public door: what the README imports comes from ``lakeloader`` itself, typed, and
``import lakeloader`` alone does not load JAX (command-line help and config checks stay fast)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lakeloader


def test_every_public_name_resolves() -> None:
    for name in lakeloader.__all__:
        assert getattr(lakeloader, name) is not None, name
    assert set(lakeloader.__all__) <= set(dir(lakeloader))


def test_the_names_are_the_stage_objects() -> None:
    from lakeloader.feed.jax import JaxFeed
    from lakeloader.feed.loader import Loader

    assert lakeloader.Loader is Loader
    assert lakeloader.JaxFeed is JaxFeed


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        lakeloader.NoSuchThing  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("lakeloader.NoSuchThing resolved")


def test_import_lakeloader_does_not_load_jax() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, lakeloader; print('jax' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_package_is_typed() -> None:
    assert (Path(lakeloader.__file__).parent / "py.typed").exists()
