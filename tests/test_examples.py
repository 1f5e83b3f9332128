"""The trainer examples run as documented (shortened)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CAP

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, needs", [("hf_trainer.py", "accelerate"), ("lightning_train.py", "lightning")]
)
def test_a_trainer_example_runs(script, needs):
    pytest.importorskip(needs)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=CAP,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "optimizer steps" in out.stdout and "heuristic" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule", [(), ("--schedule", "interleaved-1f1b", "--stages-per-rank", "2")]
)
def test_the_pipeline_example_runs_under_torchrun(schedule):
    """examples/pipeline_train.py as documented: torchrun, 2 gloo processes, 1F1B and
    interleaved 1F1B (two stages a rank); every rank plans its stages and trains its later
    steps under the plans."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         f"--master_port={port}", str(ROOT / "examples" / "pipeline_train.py"), "--steps", "3",
         *schedule],
        capture_output=True,
        text=True,
        timeout=CAP,
        cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: " in out.stdout and f"rank {rank} step 2:" in out.stdout, out.stdout
