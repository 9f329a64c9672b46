"""Plain specs (contracts/specs.py) built from the config in one place (lakeloader/specs.py): the
mixture, packing and template specs keep the ids stored in existing lakes; one schedule feeds the
loader, the audit and the catalog, and the catalog's SQL macro (the analyst's view) equals it bit
for bit; weights are validated once; the index maps import neither the config nor the feed."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import lakeloader
from lakeloader.catalog.audit import closed_form_plan
from lakeloader.catalog.store import CatalogWriter
from lakeloader.config import load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.contracts.specs import MixtureSpec, Stage, check_weights
from lakeloader.index.mixture import Mixer, schedule, staged_assignments
from lakeloader.specs import dataset_names, mixture_spec, packing_specs, template_for

from conftest import DEMO_TOKENIZER, REPO, write_config

PLAN_INTEGERS = ["step", "stage", "examples", "before", "after", "stage_before", "stage_after", "stage_examples"]


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> CatalogWriter:
    writer = CatalogWriter(str(tmp_path_factory.mktemp("specs") / "catalog.duckdb"))
    yield writer
    writer.close()


@st.composite
def mixtures(draw: st.DrawFn) -> tuple[MixtureSpec, int, int]:
    """A random staged mixture (weights over 9 decades, zeros included) and a step range."""
    datasets = draw(st.integers(1, 7))
    later = draw(st.lists(st.integers(1, 10**6), max_size=3, unique=True))
    starts = [0, *sorted(later)]
    weight = st.one_of(st.just(0.0), st.floats(-9, 0).map(lambda e: 10.0 ** e))
    stages = []
    for start in starts:
        weights = draw(st.lists(weight, min_size=datasets, max_size=datasets))
        weights[draw(st.integers(0, datasets - 1))] = draw(st.floats(0.01, 1.0))
        stages.append(Stage(start, weights))
    spec = MixtureSpec(tuple(f"d{i}" for i in range(datasets)), tuple(stages), draw(st.integers(1, 4096)),
                       "restart", draw(st.integers(0, 2**32)))
    around = draw(st.sampled_from(starts))  # ranges that cross stage boundaries too
    first = max(0, around + draw(st.integers(-20, 20)))
    return spec, first, first + draw(st.integers(1, 40))


def _bits(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, np.float64).view(np.int64)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mixtures())
def test_sql_macro_equals_the_python_schedule_bitwise(catalog: CatalogWriter, case: tuple[MixtureSpec, int, int]) -> None:
    spec, first, stop = case
    catalog.register_mixture(spec)
    sql = catalog.con.execute("SELECT * FROM mixture_plan(?, ?, ?)", [spec.mixture_id, first, stop]).df()
    counts = schedule(spec.stages, spec.batch_size, np.arange(first, stop))
    steps, datasets = stop - first, len(spec.names)
    assert len(sql) == steps * datasets
    python = {
        "step": np.repeat(counts.steps, datasets), "stage": np.repeat(counts.stage, datasets),
        "examples": (counts.after - counts.before).reshape(-1), "before": counts.before.reshape(-1),
        "after": counts.after.reshape(-1), "stage_before": counts.stage_before.reshape(-1),
        "stage_after": counts.stage_after.reshape(-1),
        "stage_examples": np.repeat(counts.stage_examples, datasets),
    }
    for column in PLAN_INTEGERS:
        assert np.array_equal(sql[column].to_numpy().astype(np.int64), python[column]), column
    for column in ("target_weight", "deviation"):
        assert np.array_equal(_bits(sql[column].to_numpy()), _bits(getattr(counts, column).reshape(-1))), column
    assert (counts.deviation < 2).all()
    # The audit's closed form is the same computation, framed.
    frame = closed_form_plan(spec, first, stop)
    for column in PLAN_INTEGERS:
        assert np.array_equal(frame[column].to_numpy().astype(np.int64), python[column]), column
    # ... and so are the loader's batches: each step draws exactly stream indices [before, after).
    owners, indices = staged_assignments(spec.stages, spec.batch_size, counts.steps, 7)
    for row in range(steps):
        for d in range(datasets):
            mine = np.sort(indices[row][owners[row] == d])
            assert np.array_equal(mine, np.arange(counts.before[row, d], counts.after[row, d])), (row, d)


def test_specs_keep_the_ids_stored_in_existing_lakes() -> None:
    """mixture_id, plan_key and template fingerprints hash exactly what they hashed before the
    specs moved to contracts (lakes built before store them)."""
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER))
    demo = load_config(REPO / "configs" / "demo.yaml")
    assert mixture_spec(demo).mixture_id == "e7cbbf9850637e5e"
    assert {n: template_for(n, demo, tokenizer).fingerprint for n in dataset_names(demo)} == dict.fromkeys(
        ("code", "docs", "notes"), "e5a0b5169ed24bfb6dd7397c3881a593")
    formats = load_config(REPO / "configs" / "formats.yaml")
    means = {n: 100.0 + i * 7.3 for i, n in enumerate(dataset_names(formats))}
    assert mixture_spec(formats, means).mixture_id == "369e9db0bd5f54b6"
    assert {n: s.plan_key for n, s in packing_specs(formats, tokenizer).items()} == {
        "chat": "86968aef88635610", "code": "722acec2ab784335", "pages": "c1ebc9e0804f273d",
        "sft": "94c0e2f03e33524f", "web": "4a109bab12109db7"}


def test_mixture_spec_applies_token_means_in_one_place(tmp_path: Path) -> None:
    datasets = {"a": {"sources": ["x.jsonl"]}, "b": {"sources": ["y.jsonl"]}, "c": {"sources": ["z.jsonl"]}}
    stages = [{"start_step": 0, "weights": {"a": 3, "b": 1}}, {"start_step": 5, "weights": {"b": 1, "c": 2}}]
    tokens = load_config(write_config(tmp_path, datasets, loader={"batch_size": 4, "seed": 3},
                                      mixture={"stages": stages, "unit": "tokens", "stop": "first_exhausted"}))
    spec = mixture_spec(tokens, {"a": 10.0, "b": 4.0, "c": 0.5})
    assert spec == MixtureSpec(("a", "b", "c"), (Stage(0, [0.3, 0.25, 0.0]), Stage(5, [0.0, 0.25, 4.0])),
                               4, "first_exhausted", 3)
    with pytest.raises(ConfigError, match="mixture.unit = 'tokens' needs each dataset's mean tokens"):
        mixture_spec(tokens)
    (tmp_path / "e").mkdir()
    examples = load_config(write_config(tmp_path / "e", datasets, mixture={"stages": stages}))
    assert mixture_spec(examples, {"a": 10.0, "b": 4.0, "c": 0.5}) == mixture_spec(examples)  # means unused
    assert mixture_spec(examples).stages[1].weights == (0.0, 1.0, 2.0)


def test_the_mixer_takes_dataset_sizes() -> None:
    mixer = Mixer.of(MixtureSpec(("a", "b"), (Stage(0, [1, 1]),), 4, "first_exhausted", 0))
    assert mixer.finite and mixer.stop_step([6, 100]) == 3  # 2 of a per batch: batch 3 needs its 7th
    assert Mixer.of(MixtureSpec(("a", "b"), (Stage(0, [1, 1]),), 4, "restart", 0)).stop_step([6, 100]) is None
    assert mixer.eval_total([3, 2]) == 5
    owners, indices = mixer.eval_assign(np.arange(7), [3, 2])
    assert owners.tolist() == [0, 0, 0, 1, 1, -1, -1] and indices.tolist() == [0, 1, 2, 0, 1, 0, 0]


def test_weights_are_validated_once_with_the_config_key(tmp_path: Path) -> None:
    datasets = {"a": {"sources": ["x.jsonl"]}, "b": {"sources": ["y.jsonl"]}}
    for weights, key, reason in [({"a": 1, "b": float("inf")}, "mixture.weights.b", "finite and >= 0"),
                                 ({"a": 1, "b": -2}, "mixture.weights.b", "finite and >= 0"),
                                 ({"a": 0, "b": 0}, "mixture.weights", "all zero")]:
        path = write_config(tmp_path, datasets, mixture={"weights": weights})
        with pytest.raises(ConfigError, match=rf"line \d+, {key}: .*{reason}"):
            load_config(path)
    with pytest.raises(ValueError, match="finite and >= 0"):
        check_weights([1.0, float("nan")])


def test_index_maps_import_neither_config_nor_feed() -> None:
    index = Path(lakeloader.__file__).parent / "index"
    found = []
    for path in sorted(index.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # any depth: lazy and TYPE_CHECKING too
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(path.name, n) for n in names if n.startswith(("lakeloader.config", "lakeloader.feed",
                                                                      "lakeloader.specs"))]
    assert not found
