"""The command line: every command, its output files, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from slackswap.cli import main
from slackswap.compare import RESULT_FIELDS

GRAPH = {
    "format": "slackswap.graph/1",
    "name": "tiny",
    "ops": [
        {"name": "A", "forward_s": 0.001, "backward_s": 0.002, "inputs": ["x"], "outputs": ["a"]},
        {"name": "B", "forward_s": 0.003, "backward_s": 0.006, "inputs": ["a"], "outputs": ["b"]},
        {"name": "C", "forward_s": 0.001, "backward_s": 0.002, "inputs": ["b"], "outputs": ["c"]},
    ],
    "tensors": [
        {"name": "a", "bytes": 4 * 2**20, "saved_for": ["B"]},
        {"name": "b", "bytes": 2**20, "saved_for": ["C"]},
        {"name": "c", "bytes": 2**20, "saved_for": ["C"]},
    ],
}


@pytest.fixture
def graph_file(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(GRAPH))
    return path


@pytest.mark.slow  # the plots take most of its 4 s
def test_solve_simulate_plot(graph_file, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert (
        main(["solve", str(graph_file), "--budget", "0.9", "--solver", "cpsat", "--out", str(plan)])
        == 0
    )
    data = json.loads(plan.read_text())
    assert data["format"] == "slackswap.plan/2" and set(data["decisions"]) == {"a", "b", "c"}
    # closed: the hardware and a position for every swap and recompute travel with the plan
    assert data["hardware"]["name"] == "a100-80gb-pcie4"
    swapped = {t for t, d in data["decisions"].items() if d == "swap"}
    assert set(data["schedule"]["d2h_free"]) == set(data["schedule"]["h2d_issue"]) == swapped
    assert main(["simulate", str(graph_file), str(plan)]) == 0
    out = capsys.readouterr().out
    assert "retention" in out and "forward A" in out and "D2H" in out
    prefix = tmp_path / "fig"
    assert main(["plot", str(graph_file), str(plan), "--out", str(prefix)]) == 0
    for suffix in ("-memory.png", "-memory.svg", "-lanes.png", "-lanes.svg"):
        assert (tmp_path / f"fig{suffix}").stat().st_size > 1000


@pytest.mark.slow
def test_compare(graph_file, capsys):
    assert (
        main(
            ["compare", str(graph_file), "--budget", "0.9", "--solvers", "heuristic,cpsat,keep-all"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "cpsat" in out and "heuristic" in out and "over budget" in out


def test_sweep_schema_and_resumption(tmp_path):
    out = tmp_path / "rows.jsonl"
    args = [
        "sweep",
        "--workloads",
        "bert-large",
        "--budgets",
        "0.5,0.9",
        "--solvers",
        "heuristic,swap-all",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:
        # the one row schema of compare(), the sweep and the benchmarks
        assert set(RESULT_FIELDS) | {"workload", "budget_fraction"} <= set(r)
        assert r["status"] in ("heuristic", "baseline", "infeasible")
        assert r["workload"] == "bert-large" and r["solver"] in ("heuristic", "swap-all")
    # resumable: nothing is run twice, missing rows are added
    assert main(args) == 0
    assert len(out.read_text().splitlines()) == 4
    assert main(args[:4] + ["0.5,0.9,0.7"] + args[5:] + ["--workers", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and {r["budget_fraction"] for r in rows} == {0.5, 0.7, 0.9}


def test_profile_command(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))\n"
        "    return m, torch.randn(4, 8), lambda out: out.pow(2).mean()\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "mymodel:build", "--out", "g.json", "--repeat", "1"]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["format"] == "slackswap.graph/1"
    assert main(["profile", "mymodel:nothere", "--out", "g.json"]) == 2
    assert main(["profile", "nomodule:build", "--out", "g.json"]) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["solve", "no-such-workload", "--budget", "0.5"], "neither a graph file nor a workload"),
        (["solve", "bert-large", "--budget", "lots"], "budget"),
        (["solve", "bert-large", "--budget", "1e-9", "--solver", "heuristic"], "cannot fit"),
        (["solve", "bert-large", "--budget", "0.5", "--solver", "gurobi"], "unknown solver"),
        (["solve", "bert-large", "--budget", "0.5", "--hardware", "tpu"], "unknown hardware"),
        (["solve", "bert-large", "--budget", "0.5", "--time-limit", "abc"], "--time-limit"),
        (["solve", "bert-large"], "--budget"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and "Traceback" not in err


def test_bad_graph_file_and_help(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**GRAPH, "format": "nope"}))
    assert main(["solve", str(bad), "--budget", "0.5"]) == 2
    for cmd in ("solve", "compare", "sweep", "simulate", "plot", "profile"):
        result = subprocess.run(
            [sys.executable, "-m", "slackswap.cli", cmd, "--help"], capture_output=True, text=True
        )
        assert result.returncode == 0 and "usage" in result.stdout


@pytest.mark.parametrize("case", ["a folder", "under a file", "a read-only folder"])
def test_an_unwritable_out_is_refused_before_the_solve(case, tmp_path, capsys):
    """One line, exit status 2, and no solve first (before: a traceback after the solve)."""
    if case == "a folder":
        path = str(tmp_path)
    elif case == "under a file":
        (tmp_path / "file.txt").write_text("x")
        path = str(tmp_path / "file.txt" / "plan.json")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        path = str(ro / "plan.json")
    code = main(["solve", "gpt2-xl", "--budget", "0.5", "--solver", "cpsat", "--out", path])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.startswith("slackswap: error: --out")
    assert len(captured.err.splitlines()) == 1 and "Traceback" not in captured.err
    assert "solving" not in captured.out + captured.err  # refused before any work
