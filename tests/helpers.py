"""Small graph builders and a random-DAG strategy shared by the tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import slackswap as ss

LINK = ss.Hardware(
    name="test-link",
    d2h_bytes_per_s=100.0,
    h2d_bytes_per_s=100.0,
    latency_s=0.0,
    duplex=True,
    peak_flops=1e12,
    hbm_bytes_per_s=1e12,
)
HALF_DUPLEX = LINK.with_link(name="test-half", duplex=False)
# a clock cap far above any test's work (work_s sets the work): results do not depend on how busy
# or slow the machine is, and no test passes or fails by the clock
CAP = 600.0


def op(name, fwd, bwd, inputs=(), outputs=(), **kw):
    return {
        "name": name,
        "forward_s": fwd,
        "backward_s": bwd,
        "inputs": list(inputs),
        "outputs": list(outputs),
        **kw,
    }


def tensor(name, nbytes, saved_for=(), **kw):
    return {"name": name, "bytes": nbytes, "saved_for": list(saved_for), **kw}


def graph(ops, tensors, name="g", optimizer_s=0.0):
    return ss.load_graph(
        {
            "format": "slackswap.graph/1",
            "name": name,
            "ops": ops,
            "tensors": tensors,
            "optimizer_s": optimizer_s,
        }
    )


def open_plan(g, decisions, budget, schedule=None):
    """A hand-made plan as a user writes one: decisions, maybe some positions, no hardware."""
    return ss.Plan(
        graph_name=g.name,
        graph_digest=g.digest,
        budget_bytes=int(budget),
        decisions=decisions,
        schedule=None if schedule is None else ss.Schedule(**schedule),
    )


def plan(g, decisions, budget, schedule=None, hw=None):
    """A hand-made plan closed once by ss.complete (on the test link unless told otherwise)."""
    return ss.complete(open_plan(g, decisions, budget, schedule), g, LINK if hw is None else hw)


@st.composite
def random_graphs(draw, max_ops: int = 7, max_saved: int | None = None):
    """Random DAGs in forward order: each op reads earlier tensors, produces 1-2 tensors, and
    saves a random subset of what it reads and produces."""
    n = draw(st.integers(2, max_ops))
    ops, tensors = [], []
    produced: list[str] = []
    saved_count = 0
    for i in range(n):
        k_in = draw(st.integers(0, min(2, len(produced))))
        inputs = (
            draw(st.lists(st.sampled_from(produced), min_size=k_in, max_size=k_in, unique=True))
            if produced and k_in
            else []
        )
        if draw(st.booleans()):
            inputs = inputs + ["batch"]
        outs = [f"t{i}_{j}" for j in range(draw(st.integers(1, 2)))]
        name = f"op{i}"
        fwd = draw(st.floats(0.0, 2.0, allow_nan=False))
        bwd = draw(st.floats(0.0, 3.0, allow_nan=False))
        kw = {}
        if draw(st.integers(0, 4)) == 0:
            kw["forward_workspace_bytes"] = draw(st.integers(0, 300))
        if draw(st.integers(0, 4)) == 0:
            kw["backward_workspace_bytes"] = draw(st.integers(0, 300))
        if draw(st.integers(0, 4)) == 0:  # gradients waiting when its backward begins
            kw["rerun_workspace_bytes"] = draw(st.integers(0, 300))
        if ops and draw(st.integers(0, 5)) == 0:  # an op that reruns with it (a checkpoint's)
            kw["rerun_with"] = [draw(st.sampled_from([o["name"] for o in ops]))]
        ops.append(op(name, fwd, bwd, inputs, outs, **kw))
        for o in outs:
            tensors.append(tensor(o, draw(st.integers(0, 500))))
        for t in inputs + outs:
            if t == "batch":
                continue
            if max_saved is not None and saved_count >= max_saved:
                break
            if draw(st.booleans()):
                entry = next(x for x in tensors if x["name"] == t)
                if not entry["saved_for"]:
                    saved_count += 1
                entry["saved_for"].append(name)
        produced.extend(outs)
    return graph(ops, tensors, name="random")


@st.composite
def random_plans(draw, low: float = 0.25, high: float = 2.0):
    """A random graph, a random keep/swap/recompute plan for it, and a budget between ``low``
    and ``high`` times its keep-all peak."""
    import slackswap

    g = draw(random_graphs())
    decisions = {}
    for t in g.saved:
        choices = ["keep", "swap"] + (["recompute"] if g.can_recompute[t] else [])
        decisions[g.tensors[t].name] = draw(st.sampled_from(choices))
    peak = slackswap.keep_all_peak(g, LINK)
    budget = draw(st.integers(max(1, int(peak * low)), max(1, int(peak * high))))
    return g, plan(g, decisions, budget)


def seeded_graph(seed: int, n_ops: int = 8, groups: bool = True):
    """A random graph from a numpy seed (deterministic, for tests that count what they find):
    chains, skips, multi-reader saves, workspaces, RNG groups and non-recomputable ops."""
    rng = np.random.default_rng(seed)
    ops, tensors, produced = [], [], []
    for i in range(n_ops):
        k = int(rng.integers(0, min(2, len(produced)) + 1))
        inputs = list(rng.choice(produced, size=k, replace=False)) if k else []
        if rng.random() < 0.3:
            inputs.append("batch")
        outs = [f"t{i}_{j}" for j in range(int(rng.integers(1, 3)))]
        kw = {}
        if rng.random() < 0.3:
            kw["forward_workspace_bytes"] = int(rng.integers(1, 300))
        if rng.random() < 0.3:
            kw["backward_workspace_bytes"] = int(rng.integers(1, 300))
        if rng.random() < 0.1:
            kw["recomputable"] = False
        ops.append(
            op(
                f"op{i}",
                float(rng.uniform(0.1, 2.0)),
                float(rng.uniform(0.1, 3.0)),
                inputs,
                outs,
                **kw,
            )
        )
        for o in outs:
            tensors.append(tensor(o, int(rng.integers(1, 500))))
        for name in inputs + outs:
            if name != "batch" and rng.random() < 0.6:
                entry = next(x for x in tensors if x["name"] == name)
                if f"op{i}" not in entry["saved_for"]:
                    entry["saved_for"].append(f"op{i}")
        produced.extend(outs)
    if groups:
        saved = [t for t in tensors if t["saved_for"]]
        if len(saved) >= 2 and rng.random() < 0.5:
            for t in rng.choice(saved, size=2, replace=False):
                t["group"] = "rng0"
    return graph(ops, tensors, name=f"seeded-{seed}")


def seeded_decisions(g, seed: int) -> dict:
    """Random keep / swap / recompute for ``g`` that respects recomputability and RNG groups."""
    rng = np.random.default_rng(seed)
    decisions = {}
    for t in g.saved:
        choices = ["keep", "swap"] + (["recompute"] if g.can_recompute[t] else [])
        decisions[g.tensors[t].name] = str(rng.choice(choices))
    for members in g.rng_groups.values():
        rebuild = all(g.can_recompute[m] for m in members) and rng.random() < 0.5
        for m in members:
            name = g.tensors[m].name
            if rebuild:
                decisions[name] = "recompute"
            elif decisions[name] == "recompute":
                decisions[name] = "keep"
    return decisions
