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
