"""The notebooks run top to bottom (on a private copy of the demo lake)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import yaml
from conftest import REPO, DEMO_TOKENIZER
from nbclient import NotebookClient

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def demo_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("notebooks")
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["lake"] = str(tmp / "lake")
    config["tokenizer"] = str(DEMO_TOKENIZER)
    for dataset in config["datasets"].values():
        dataset["sources"] = [s.replace("../demo/data", str(tmp / "data")) for s in dataset["sources"]]
    path = tmp / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return {"LAKELOADER_DEMO_CONFIG": str(path), "LAKELOADER_DEMO_DATA": str(tmp / "data"),
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


def test_every_notebook_is_committed_with_outputs() -> None:
    assert [p.stem for p in NOTEBOOKS][:4] == ["01_build_lake", "02_catalog_sql", "03_stream_to_jax", "04_audit_mixture"]
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert code and all(c.get("outputs") is not None for c in code)
        assert sum(bool(c.outputs) for c in code) >= len(code) // 2, f"{path.name} was committed without outputs"
        errors = [o for c in code for o in c.outputs if o.get("output_type") == "error"]
        assert not errors, f"{path.name} was committed with an error"


def test_notebooks_run_top_to_bottom(demo_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in demo_env.items():
        monkeypatch.setenv(key, value)
    for path in NOTEBOOKS:  # in order: 01 builds the lake the others read
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
        assert not [o for o in outputs if o.get("output_type") == "error"], path.name
    assert (Path(demo_env["LAKELOADER_DEMO_CONFIG"]).parent / "lake" / "catalog.duckdb").exists()
