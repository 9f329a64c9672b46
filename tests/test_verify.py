"""`lakeloader verify`: every chunk checked against the catalog; problems listed, exit status 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from lakeloader.catalog.lake import open_lake
from lakeloader.cli import main
from lakeloader.read.verify import verify_lake



def test_verify_finds_missing_corrupt_and_truncated_chunks(built_lake: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = built_lake
    assert (verify_lake(config, progress=False).status == "ok").all()
    assert main(["verify", str(config), "--no-progress"]) == 0

    lake = open_lake(config)
    paths = lake.sql("SELECT path FROM chunks ORDER BY global_index").path.tolist()
    assert len(paths) >= 4
    Path(lake.path_of(paths[0])).unlink()
    data = bytearray(Path(lake.path_of(paths[1])).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(lake.path_of(paths[1])).write_bytes(bytes(data))
    Path(lake.path_of(paths[2])).write_bytes(data[:100])
    report = verify_lake(config, progress=False).set_index("path")
    assert report.loc[paths[0], "status"] == "missing"
    assert report.loc[paths[1], "status"] == "checksum"
    assert report.loc[paths[2], "status"] == "size"
    assert (report.drop(index=paths[:3]).status == "ok").all()
    assert main(["verify", str(config), "--no-progress", "--format", "csv"]) == 1
    out = capsys.readouterr()
    assert paths[0] in out.out and "missing" in out.out and "checksum" in out.out
    assert "ok, 1 missing, 1 checksum, 1 size" in out.err
