"""What a step holds beside its tensors: a thread that misses a kernel's own memory in one step
does not decide the graph; the graph says how its figure was measured."""

import pytest
from helpers import graph, op, tensor

from slackswap.runtime.overhead import THREAD_STEPS, measured_overhead_bytes


def small():
    """One op saving 100 B: keep-all peak 100 B (+ the 10 B output)."""
    return graph(
        [op("A", 1e-3, 2e-3, [], ["a"]), op("B", 1e-3, 2e-3, ["a"], ["b"])],
        [tensor("a", 100, ["B"]), tensor("b", 10)],
    )


def scripted(thread_figures):
    """A meter whose after-every-op figure is 200 B and whose thread sees, step by step,
    ``thread_figures``: a kernel's 1,000 B inside an op in the steps where it was scheduled."""
    seen = list(thread_figures)
    calls = []

    def measure(sample):
        calls.append(sample)
        return 200 if sample == "ops" else seen.pop(0)

    return measure, calls


@pytest.mark.parametrize(
    "figures",
    [
        [210, 1200, 210],  # missed in the first step, seen in the second
        [210, 210, 1200],
        [1200, 210, 210],
    ],
)
def test_a_kernel_seen_in_any_thread_step_is_counted(figures):
    g = small()
    keep_all = 110  # a (100 B) and b (10 B) at once
    measure, calls = scripted(figures)
    overhead, measured, how = measured_overhead_bytes(g, measure)
    assert measured == 1200 and overhead == 1200 - keep_all
    # always THREAD_STEPS thread steps: under DDP every rank runs as many plain steps
    assert how["thread_bytes"] == figures and len(figures) == THREAD_STEPS
    assert calls == ["ops", "ops"] + ["thread"] * THREAD_STEPS
    assert how["after_every_op_bytes"] == 200 and "maximum" in how["method"]
