"""Per-domain ids in every batch (issue 14 item 5): ``dataset_ids`` (int32 per row) is each row's
dataset position in ``dataset_names(config)`` (-1 for eval padding rows), the same in
``Loader.batch``, ``iter_from``, ``JaxFeed`` and ``lakeloader batches``, and ``explain`` lists it."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from lakeloader.cli import main
from lakeloader.feed.jax import JaxFeed
from lakeloader.feed.loader import Loader
from lakeloader.specs import dataset_names

SEQ_LEN = 32
BATCH = 8
STEPS = 6


@pytest.fixture(scope="module")
def lake(two_dataset_lake: dict[str, Path]) -> dict[str, Path]:
    """Two datasets in a 0.6/0.4 mixture; a config per packing (seq_len 32, batch 8)."""
    return two_dataset_lake


@pytest.mark.parametrize("packing", ["concat", "pack"])
@pytest.mark.parametrize("processes", [1, 2])
def test_dataset_ids_match_explain_for_every_row(lake: dict[str, Path], packing: str, processes: int) -> None:
    seen = set()
    for p in range(processes):
        with Loader(lake[packing], process_index=p, process_count=processes) as loader:
            names = dataset_names(loader.config)
            assert names == ("a", "b")
            for step, batch in zip(range(STEPS), loader.iter_from(0)):
                ids = batch["dataset_ids"]
                assert ids.dtype == np.int32 and ids.shape == (loader.rows,)
                assert np.array_equal(ids, loader.batch(step)["dataset_ids"])
                frame = loader.explain(step)
                for local, row in enumerate(loader.row_indices.tolist()):
                    of_row = frame[frame["row"] == row]
                    assert len(of_row) >= 1
                    assert set(of_row["dataset_id"]) == {int(ids[local])}, (step, row)
                    assert set(of_row["dataset"]) == {names[int(ids[local])]}, (step, row)
                    seen.add(int(ids[local]))
    assert seen == {0, 1}   # both datasets feed these steps


def test_eval_padding_rows_have_id_minus_one(lake: dict[str, Path]) -> None:
    with Loader(lake["concat"], mode="eval") as loader:
        last = loader.num_batches() - 1
        batch = loader.batch(last)
        padding = batch["example_mask"] == 0
        assert padding.any()
        assert (batch["dataset_ids"][padding] == -1).all() and (batch["dataset_ids"][~padding] >= 0).all()
        frame = loader.explain(last)
        padded_rows = set(loader.row_indices[padding].tolist())
        assert set(frame[frame["row"].isin(padded_rows)]["dataset_id"]) == {-1}
        assert loader.batch(0)["dataset_ids"].tolist() == [0] * BATCH   # the pass reads dataset a first


def test_npz_and_jax_feed_carry_dataset_ids(lake: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "b.npz"
    assert main(["batches", str(lake["pack"]), "--steps", f"0:{STEPS}", "--out", str(out)]) == 0
    with Loader(lake["pack"]) as loader, np.load(out) as data:
        expected = np.stack([loader.batch(s)["dataset_ids"] for s in range(STEPS)])
        assert data["dataset_ids"].dtype == np.int32 and np.array_equal(data["dataset_ids"], expected)
        # What the ids number travels with them: the file, the Loader and dataset_names of the config.
        assert data["dataset_names"].tolist() == list(loader.dataset_names) == list(dataset_names(lake["pack"])) \
            == ["a", "b"]
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with JaxFeed(lake["pack"], mesh, prefetch=0) as feed:
        for step, batch in zip(range(2), feed.iter_from(0)):
            assert np.array_equal(np.asarray(batch["dataset_ids"]), expected[step])
