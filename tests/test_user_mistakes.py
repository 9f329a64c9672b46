"""User mistakes get a one-line error, not a traceback, and no time wasted first; the local
build's Dask dashboard is reachable from this host only unless opened."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lakeloader.catalog.lake import open_lake
from lakeloader.cli import build_parser, main
from lakeloader.config import load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.cluster import dask_client
from lakeloader.ingest.driver import build
from lakeloader.tokenizer import load_tokenizer

from conftest import stdlib_texts, write_config, write_jsonl

CLI = [sys.executable, "-m", "lakeloader.cli"]


@pytest.fixture(scope="module")
def lake_config(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Iterator[Path]:
    """A small built lake (seq_len 64, batch 4) and its config."""
    root = tmp_path_factory.mktemp("mistakes")
    write_jsonl(root / "data" / "a.jsonl", stdlib_texts("json"))
    config = write_config(root, {"code": {"sources": [str(root / "data" / "a.jsonl")]}},
                          loader={"seq_len": 64, "batch_size": 4})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LAKELOADER_CACHE", str(root / "cache"))
        build(config, scheduler=dask_scheduler, progress=False)
        yield config


def listening_hosts(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_dashboard_on_loopback_unless_opened() -> None:
    with dask_client(1) as client:
        port = client.scheduler_info()["services"]["dashboard"]
        assert listening_hosts(port) == {"127.0.0.1"}
        assert client.dashboard_link == f"http://127.0.0.1:{port}/status"  # the printed address is real
    with dask_client(1, dashboard="0.0.0.0:0") as client:
        assert listening_hosts(client.scheduler_info()["services"]["dashboard"]) == {"0.0.0.0"}
    args = build_parser().parse_args(["build", "c.yaml", "--dashboard-address", "0.0.0.0:8787"])
    assert args.dashboard_address == "0.0.0.0:8787"


def test_build_dashboard_listens_where_asked(tmp_path: Path) -> None:
    with socket.socket() as probe:   # a port free now, so the build's dashboard can take it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    write_jsonl(tmp_path / "docs.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"docs": {"sources": [str(tmp_path / "docs.jsonl")]}})
    report = build(config, workers=1, progress=False, dashboard_address=f"127.0.0.1:{port}")
    assert report.dashboard == f"http://127.0.0.1:{port}/status"


def test_steps_out_of_range_name_the_valid_range(lake_config: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(lake_config), "--step", "-1"]) == 2
    assert "step -1 does not exist: valid are steps 0 and up" in capsys.readouterr().err
    with Loader(lake_config, mode="eval") as loader:
        total = loader.num_batches()
    assert main(["batches", str(lake_config), "--mode", "eval", "--steps", f"0:{total + 5}",
                 "--out", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert f"step {total + 4} does not exist: valid are steps 0..{total - 1}; the eval pass has {total} batches" in err
    assert not (tmp_path / "x.npz").exists()
    assert main(["explain", str(lake_config), "--mode", "eval", "--step", str(total)]) == 2
    assert f"valid are steps 0..{total - 1}" in capsys.readouterr().err


def test_batches_out_folder_checked_before_any_batch(lake_config: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    computed: list[int] = []
    original = Loader.batch
    monkeypatch.setattr(Loader, "batch", lambda self, step: computed.append(step) or original(self, step))
    out = tmp_path / "missing" / "dir" / "x.npz"
    assert main(["batches", str(lake_config), "--steps", "0:3", "--out", str(out)]) == 2
    assert f"folder {out.parent} does not exist" in capsys.readouterr().err
    assert computed == []
    assert main(["batches", str(lake_config), "--steps", "0:3", "--out", str(tmp_path / "x.npz")]) == 0
    assert computed == [0, 1, 2]


def test_closed_stdout_pipe_exits_quietly(lake_config: Path) -> None:
    """`lakeloader status LAKE | head -3`: the reader leaves early; no traceback, status 141."""
    process = subprocess.Popen([*CLI, "status", str(lake_config)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before the first write
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


def test_malformed_jsonl_prints_only_the_clean_message(tmp_path: Path) -> None:
    source = tmp_path / "a.jsonl"
    source.write_text('{"text": "fine"}\n{"text": "broken\n{"text": "ok"}\n')
    config = write_config(tmp_path, {"d": {"sources": [str(source)]}})
    result = subprocess.run([*CLI, "build", str(config), "--workers", "1", "--no-progress"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert f"{source}: line 2: malformed JSON" in result.stderr
    assert "Compute Failed" not in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("lake: ./lake\ntokenizer: t.json\ndatasets: {web: {sources: [a.jsonl]}\nloader: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not valid YAML: line 4, column ") and "<unicode string>" not in message


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_hub_tokenizer_unreachable_fails_in_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_tokenizer("gpt2")
    seconds = time.monotonic() - started
    assert "'gpt2' is not a file" in str(info.value) and "the hub is unreachable" in str(info.value)
    assert "Retrying" not in caplog.text
    assert seconds < 10, seconds  # the hub client's retries alone take 23 s


def test_hub_offline_mode_uses_the_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        load_tokenizer("lakeloader-test/no-such-tokenizer")
    assert time.monotonic() - started < 5


def test_hub_log_records_printed_once() -> None:
    script = (
        "import logging; logging.basicConfig(format='APP %(message)s')\n"
        "from lakeloader.tokenizer import load_tokenizer\n"
        "try: load_tokenizer('lakeloader-test/no-such-tokenizer')\n"
        "except Exception: pass\n"
        "logging.getLogger('huggingface_hub.utils._http').warning('retrying once')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.stderr.count("retrying once") == 1 and "APP retrying once" in result.stderr, result.stderr


MODEL_LEVEL = """\
lake: ./lake
tokenizer: t.json
datasets:
  web:
    sources: [a.jsonl]
    format: chat
    chat:
      loss_roles: [robot]
  code:
    sources: [b.jsonl]
    fim: {rate: 0.1}
mixture:
  stages:
    - {start_step: 3, weights: {web: 1}}
"""


def test_model_level_errors_name_the_key_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(MODEL_LEVEL)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert lines[1].startswith("  line 8, datasets.web.chat.loss_roles: loss_roles names role(s) ['robot']")
    assert lines[2].startswith("  line 11, datasets.code.fim: section 'fim' applies to format: fim")
    assert lines[3] == "  line 14, mixture.stages.0.start_step: the first stage must have start_step: 0"
    assert "a.jsonl" not in str(info.value) and "b.jsonl" not in str(info.value)  # no mapping printed


def test_a_build_that_cannot_start_leaves_no_lake_and_records_its_run(tmp_path: Path, dask_scheduler: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A missing tokenizer or source fails a build before it runs: a new lake is not left behind,
    and in a lake that exists the run has its failed builds row (issue 48, item 6)."""
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    datasets = {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}}
    config = write_config(tmp_path, datasets, tokenizer=str(tmp_path / "missing.json"))
    assert main(["build", str(config), "--scheduler", dask_scheduler, "--no-progress"]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert not (tmp_path / "lake").exists()
    config = write_config(tmp_path, datasets)
    build(config, scheduler=dask_scheduler, progress=False)
    for mistake in ({"tokenizer": str(tmp_path / "missing.json")},
                    {"datasets": {"code": {"sources": [str(tmp_path / "data" / "gone.jsonl")]}}}):
        broken = write_config(tmp_path, mistake.get("datasets", datasets),
                              **{k: v for k, v in mistake.items() if k != "datasets"})
        assert main(["build", str(broken), "--scheduler", dask_scheduler, "--no-progress"]) == 2
        capsys.readouterr()
    builds = open_lake(config).sql("SELECT status, error FROM builds ORDER BY build_id")
    assert builds.status.tolist() == ["succeeded", "failed", "failed"]
    assert "missing.json" in builds.error[1] and "gone.jsonl" in builds.error[2]
