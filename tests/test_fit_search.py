"""The largest batch that fits: a size at which fit finds a plan and one above at which it finds
none, and the strategies users compare at it."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import slackswap as ss  # noqa: E402
from slackswap.cli import main  # noqa: E402
from slackswap.fit_search import STRATEGIES, largest_fit  # noqa: E402
from slackswap.runtime.hf_models import meta_model, training_batch  # noqa: E402

HW = "a100-80gb-pcie4"
SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 4,
    "vocab_size": 2000,
    "max_position_embeddings": 512,
}


def _graph_at(seq):
    model, config = meta_model("llama", SMALL)

    def at(batch):
        inputs, loss_fn = training_batch(config, seq, batch)
        return ss.profile(model, inputs, loss_fn, fake=True, hardware=HW)

    return at


@pytest.mark.slow  # about ten fits, each with its smallest budget's exact model
def test_the_largest_batch_fits_and_the_next_does_not():
    at = _graph_at(128)
    state = at(1).extra["model_state"]
    # memory for the model state and about three batches' keep-all activations: a plan reaches
    # further than keep-all, but not without end
    per_batch = ss.keep_all_peak(at(2), HW) - ss.keep_all_peak(at(1), HW)
    memory = state["total_bytes"] + state["optimizer_step_bytes"] + 3 * per_batch
    found = largest_fit(at, HW, memory_bytes=memory, solver="heuristic", tokens_per_size=128)
    assert found.size >= 3  # keep-all alone fits three
    assert found.report is not None and found.report.fits
    assert found.above is not None and not found.above.fits
    # fit agrees at both sizes, asked directly
    assert ss.fit(at(found.size), HW, memory_bytes=memory, solver="heuristic").fits
    assert not ss.fit(at(found.size + 1), HW, memory_bytes=memory, solver="heuristic").fits
    assert found.tried[found.size] and not found.tried[found.size + 1]
    # every strategy is compared at the answer; the slackswap plan fits there
    names = [r.strategy for r in found.rows]
    assert names == [name for name, _ in STRATEGIES] + ["slackswap"]
    assert found.rows[-1].fits
    keep = found.rows[0]
    assert keep.tokens_per_s == pytest.approx(found.size * 128 / keep.step_s)


def test_a_device_too_small_for_one_batch_says_so():
    at = _graph_at(128)
    state = at(1).extra["model_state"]
    found = largest_fit(at, HW, memory_bytes=state["total_bytes"] + 1, solver="heuristic")
    assert found.size == 0 and found.report is None and not found.above.fits


def test_an_unknown_solver_is_refused_before_any_size_is_searched():
    def at(batch):
        raise AssertionError("a size was profiled")

    with pytest.raises(ValueError, match="unknown solver 'nope'"):
        largest_fit(at, HW, solver="nope")


def test_the_command_line_reports_plots_and_writes_the_search(tmp_path, capsys):
    """The command line's wiring, on a device too small for one batch (one fit: the search
    itself is the test above)."""
    import json

    out, plot = tmp_path / "search.json", tmp_path / "throughput"
    config = json.dumps(SMALL)
    argv = ["fit", "llama", "--hf-config", config, "--seq", "128", "--memory", "20MB"]
    argv += ["--solver", "heuristic", "--max-batch", "--out", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    found = json.loads(out.read_text())
    assert "largest batch that fits: 0 (none: not even 1)" in printed
    assert found["size"] == 0 and found["report"] is None and not found["above"]["fits"]
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert main(["fit", "llama", "--seq", "16", "--plot", str(plot)]) == 2
    assert "--plot draws the search" in capsys.readouterr().err


def _recorded_fits(monkeypatch, refuse_with_cpsat=()):
    """fit_search's ``fit``, recording (size's graph, solver) per call; with the planner named
    "cpsat" it reports no plan at the sizes of ``refuse_with_cpsat`` (a planner that finds
    none where the heuristic does)."""
    from dataclasses import replace

    import slackswap.fit_search as fs

    real, calls = fs.fit, []

    def recorded(graph, *args, solver="cpsat", **kwargs):
        size = graph.extra["size"]
        calls.append((size, solver, "gap" in kwargs))
        kwargs.pop("gap", None)  # (cpsat's option: this stand-in plans with the heuristic)
        report = real(graph, *args, solver="heuristic", **kwargs)
        if solver == "cpsat" and size in refuse_with_cpsat:
            return replace(report, plan=None, verdict="no plan found (refused by the test)")
        return replace(report, verdict=f"{report.verdict} [{solver}]") if report.fits else report

    monkeypatch.setattr(fs, "fit", recorded)
    return calls


def _sized(at):
    def sized(batch):
        g = at(batch)
        from dataclasses import replace

        return replace(g, extra={**g.extra, "size": batch})

    return sized


def _memory_for_three_batches(at):
    state = at(1).extra["model_state"]
    per_batch = ss.keep_all_peak(at(2), HW) - ss.keep_all_peak(at(1), HW)
    return state["total_bytes"] + state["optimizer_step_bytes"] + 3 * per_batch


@pytest.mark.slow
def test_the_search_decides_sizes_with_the_heuristic_and_plans_the_answer_with_the_solver(
    monkeypatch,
):
    """Inside the search, sizes that neither keep-all settles nor the offload floor are decided
    by the heuristic's fit (whether a plan fits follows from the smallest budget); the answer
    and the size above are the asked planner's reports."""
    at = _sized(_graph_at(128))
    memory = _memory_for_three_batches(at)
    calls = _recorded_fits(monkeypatch)
    found = largest_fit(at, HW, memory_bytes=memory, solver="cpsat", tokens_per_size=128, gap=0.05)
    assert found.size >= 3 and found.report.fits and found.report.verdict.endswith("[cpsat]")
    by_solver = {s: sorted({n for n, x, _ in calls if x == s}) for s in ("heuristic", "cpsat")}
    # cpsat's own option goes to cpsat alone (the heuristic would refuse it by name)
    assert all(gap == (x == "cpsat") for _, x, gap in calls), calls
    assert set(by_solver["cpsat"]) <= {found.size, found.size + 1}, calls
    assert found.size in by_solver["cpsat"]
    assert by_solver["heuristic"], calls  # some size was searched
    # every size's verdict is what fit says there
    for size, fits in found.tried.items():
        assert fits == ss.fit(at(size), HW, memory_bytes=memory, solver="heuristic").fits


@pytest.mark.slow
def test_where_the_solver_refuses_the_heuristics_answer_the_search_goes_on_below(monkeypatch):
    """A planner that finds no plan at the size the heuristic's search ends on: the search
    continues below with that planner's own verdicts, and the answer is a size it fits."""
    at = _sized(_graph_at(128))
    memory = _memory_for_three_batches(at)
    first = largest_fit(at, HW, memory_bytes=memory, solver="heuristic", tokens_per_size=128)
    refused = first.size
    _recorded_fits(monkeypatch, refuse_with_cpsat={refused})
    found = largest_fit(at, HW, memory_bytes=memory, solver="cpsat", tokens_per_size=128)
    assert found.size == refused - 1
    assert found.report.fits and found.report.verdict.endswith("[cpsat]")
    assert found.tried[refused] is False and found.tried[found.size] is True
