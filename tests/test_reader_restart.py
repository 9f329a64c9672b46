"""A reader process killed mid-run and restarted from its saved state continues exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lakeloader.feed.loader import Loader

READER = """
import json, os, sys, time
from pathlib import Path
import numpy as np
from lakeloader.feed.loader import Loader

config, out = sys.argv[1], Path(sys.argv[2])
state_file = out / "state.json"
loader = Loader(config)
state = json.loads(state_file.read_text()) if state_file.exists() else loader.state(0)


def write_atomically(path, write):
    # The process is killed at a random moment: a file is either whole or absent.
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        write(handle)
    os.replace(temporary, path)


for batch in loader.iter_from(state):
    step = state["step"]
    write_atomically(out / f"step-{step:04d}.npz", lambda handle: np.savez(handle, **batch))
    state = loader.state(step + 1)
    # saved after the batch is consumed
    write_atomically(state_file, lambda handle: handle.write(json.dumps(state).encode()))
    if step + 1 == 40:
        break
    time.sleep(0.05)
"""


@pytest.mark.parametrize("built_lake", [{"loader": {"seq_len": 32, "batch_size": 8, "shuffle": {"kind": "full"},
                                                   "seed": 5}}], indirect=True)
def test_killed_reader_resumes_from_its_saved_step(built_lake: Path, tmp_path: Path) -> None:
    config = built_lake
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-c", READER, str(config), str(out)]
    first = subprocess.Popen(command, env=os.environ.copy())
    while len(list(out.glob("step-*.npz"))) < 12:
        assert first.poll() is None, "the reader ended before it was killed"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    saved = json.loads((out / "state.json").read_text())["step"]
    # Batches 0..11 are written, so the state saved after batch 10 (step 11) at least.
    assert 11 <= saved < 40
    subprocess.run(command, check=True, env=os.environ.copy(), timeout=120)
    loader = Loader(config)
    for step in range(40):
        with np.load(out / f"step-{step:04d}.npz") as got:
            expected = loader.batch(step)
            assert set(got.files) == set(expected)
            for name in expected:
                assert np.array_equal(got[name], expected[name]), (step, name)
