"""Repeated blocks (planners/repeats.py): found from the graph alone, coarsened into a valid
smaller graph, and a coarse plan stretched back into valid decisions; the exact planner's coarse
start on a deep model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import CAP, LINK, graph, op, tensor
from hypothesis import given, settings
from hypothesis import strategies as st

import slackswap as ss
from slackswap.core.budget import keep_all_peak
from slackswap.core.plan import KEEP, RECOMPUTE, SWAP
from slackswap.core.restrict import decision_mask, first_forbidden
from slackswap.planners.heuristic import fit_to_budget
from slackswap.planners.repeats import coarsen, consistent, find_repeats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from solve_scaling import config  # noqa: E402

HW = ss.hardware("a100-80gb-pcie4")


def chain_of_blocks(blocks: int, shared: bool = True):
    """``in``, then ``blocks`` blocks of two ops (``b{j}.a`` reads the previous block's output
    and, with ``shared``, a mask made once before the blocks; ``b{j}.b`` saves both of its
    inputs), then ``head`` and ``loss``, which read the last block's output. Every block's ``a``
    output lives to the loss (``alive_until``)."""
    ops = [op("in", 1.0, 1.0, outputs=["x", "mask"])]
    tensors = [tensor("x", 10, ["b0.a"]), tensor("mask", 1)]
    prev = "x"
    for j in range(blocks):
        ops.append(
            op(
                f"b{j}.a",
                2.0,
                3.0,
                inputs=[prev] + (["mask"] if shared else []),
                outputs=[f"b{j}.h"],
            )
        )
        ops.append(op(f"b{j}.b", 1.0, 2.0, inputs=[f"b{j}.h", prev], outputs=[f"b{j}.y"]))
        tensors.append(tensor(f"b{j}.h", 40, [f"b{j}.b"], alive_until="loss"))
        tensors.append(
            tensor(
                f"b{j}.y",
                10,
                [
                    f"b{j + 1}.a" if j + 1 < blocks else "head",
                    f"b{j + 1}.b" if j + 1 < blocks else "loss",
                ],
            )
        )
        prev = f"b{j}.y"
    ops.append(op("head", 1.0, 1.0, inputs=[prev], outputs=["z"]))
    ops.append(op("loss", 1.0, 1.0, inputs=["z", prev], outputs=["l"]))
    tensors += [tensor("z", 4, ["loss"]), tensor("l", 4)]
    return graph(ops, tensors, name=f"chain-{blocks}")


def test_blocks_of_a_chain_with_a_shared_mask_and_a_tensor_to_the_loss():
    g = chain_of_blocks(16)
    r = find_repeats(g)
    # ops: in (0), b0.a (1), b0.b (2), b1.a (3), ..., b15.b (32), head, loss. Every block reads
    # the mask and lives to the loss: the same ops, outside the blocks, for all. b0 reads ``x``
    # of ``in``, outside the blocks, where the others read the block before; b15's ``y`` is
    # saved for head and loss, where the others' are saved for the next block: b1-b14 repeat,
    # 14 blocks from op 3, two ops each
    assert (r.start, r.period, r.count) == (3, 2, 14)


def test_stretch_maps_block_j_to_coarse_block_j_times_blocks_over_count():
    g = chain_of_blocks(16)
    coarse = coarsen(g, find_repeats(g), 4)
    cg = coarse.graph
    # before the 14 repeated blocks (b1-b14): in, b0; their first three (b1-b3), the last one
    # (b14) and what follows (b15, head, loss): 3 + 4 * 2 + 2 + 2 ops
    assert [o.name for o in cg.ops] == [
        "in",
        "b0.a",
        "b0.b",
        "b1.a",
        "b1.b",
        "b2.a",
        "b2.b",
        "b3.a",
        "b3.b",
        "b14.a",
        "b14.b",
        "b15.a",
        "b15.b",
        "head",
        "loss",
    ]
    # b14.a reads b3.y where it read b13.y (the dropped blocks' shift: b4-b13, 10 blocks)
    assert cg.ops[cg.op_index["b14.a"]].inputs == ("b3.y", "mask")
    assert cg.tensors[cg.tensor_index["b3.y"]].saved_for == ("b14.a", "b14.b")
    source = {g.tensors[t].name: cg.tensors[int(coarse.source[t])].name for t in g.saved}
    # b5 is block 4 of the 14: coarse block 4 * 4 // 14 = 1, which is b2; b13, block 12:
    # 12 * 4 // 14 = 3, the last coarse block, b14; b3, block 2: 2 * 4 // 14 = 0, b1; b0 and b15
    # are outside the blocks: themselves
    assert source["b5.h"] == "b2.h"
    assert source["b13.y"] == "b14.y"
    assert source["b3.h"] == "b1.h"
    assert source["b15.h"] == "b15.h" and source["b0.y"] == "b0.y"
    assert source["x"] == "x"


def test_coarse_gpt_is_the_gpt_with_fewer_layers():
    """A 32-layer GPT-style step cut to 8 layers has the 8-layer step's times, tensor sizes
    and keep-all peak (names aside). Its first layer reads the embedding, where the others
    read the layer before: 31 repeated blocks of 10 ops, of which 7 are kept, after the first."""
    g, g8 = (ss.transformer_graph(config(n), HW) for n in (32, 8))
    r = find_repeats(g)
    assert r.period == 10 and r.count == 31
    cg = coarsen(g, r, 7).graph
    assert cg.n_ops == g8.n_ops
    assert cg.ideal_step_time_s == pytest.approx(g8.ideal_step_time_s, rel=1e-12)
    assert sorted(cg.tensor_bytes.tolist()) == sorted(g8.tensor_bytes.tolist())
    assert keep_all_peak(cg, HW) == keep_all_peak(g8, HW)


def test_graphs_without_repeats():
    assert find_repeats(ss.cnn_graph("vgg16", HW)) is None  # every stage a different size
    assert find_repeats(chain_of_blocks(5)) is None  # fewer blocks than worth coarsening
    with pytest.raises(ValueError, match="blocks"):
        coarsen(chain_of_blocks(16), find_repeats(chain_of_blocks(16)), 14)


@st.composite
def repeated_graphs(draw):
    """A prefix op, ``count`` copies of a random block (1-4 ops; inputs from the block or the
    one before, a tensor of the prefix, saved by the op or its readers (so for the next block),
    an RNG group per block, a tensor kept alive to the loss), and a loss op."""
    count = draw(st.integers(13, 24))
    size = draw(st.integers(1, 4))
    shape = []
    for i in range(size):
        reads = draw(st.lists(st.integers(1, size + i), max_size=2, unique=True))  # ops back
        shape.append(
            dict(
                reads=reads,
                shared=draw(st.booleans()),
                out=draw(st.integers(1, 2)),
                bytes=draw(st.integers(1, 50)),
                fwd=draw(st.floats(0.1, 2.0)),
                save_own=draw(st.booleans()),
                save_inputs=draw(st.booleans()),
                group=draw(st.booleans()),
                alive=draw(st.booleans()),
            )
        )
    n_body = count * size
    ops = [op("in", 1.0, 1.0, outputs=["in.0", "in.shared"])]
    out_of = {0: ["in.0"]}
    saved: dict[str, list[str]] = {}
    tensors = {"in.0": tensor("in.0", 5), "in.shared": tensor("in.shared", 3)}
    names = ["in"] + [f"k{k}" for k in range(1, n_body + 1)] + ["loss"]
    for k in range(1, n_body + 1):
        s = shape[(k - 1) % size]
        inputs = [out_of[max(0, k - back)][0] for back in s["reads"]]
        if s["shared"]:
            inputs.append("in.shared")
        outs = [f"k{k}.{j}" for j in range(s["out"])]
        out_of[k] = outs
        ops.append(op(names[k], s["fwd"], 2 * s["fwd"], inputs=inputs, outputs=outs))
        block = (k - 1) // size
        for j, name in enumerate(outs):
            extra = {}
            if s["group"] and j == 0:
                extra["group"] = f"rng{block}"
            if s["alive"]:
                extra["alive_until"] = "loss"
            tensors[name] = tensor(name, s["bytes"] + j, **extra)
            if s["save_own"]:
                saved.setdefault(name, []).append(names[k])
        for x in inputs if s["save_inputs"] else ():
            saved.setdefault(x, []).append(names[k])
    ops.append(op("loss", 1.0, 1.0, inputs=[out_of[n_body][0]], outputs=["loss.0"]))
    tensors["loss.0"] = tensor("loss.0", 1)
    for name, readers in saved.items():
        tensors[name]["saved_for"] = sorted(set(readers))
    return graph(ops, list(tensors.values()), name="repeated"), count


@settings(max_examples=40, deadline=None)
@given(repeated_graphs(), st.data())
def test_coarse_graphs_and_stretched_plans_are_valid(case, data):
    g, count = case
    r = find_repeats(g)
    # blocks that read what comes before the blocks, or whose tensors are saved for or read after
    # them, differ from the rest: reads reach two blocks back, so two at each end, and one more
    # at the end where the last block's outputs differ in shape from the others'
    assert r is not None and r.count >= count - 5
    blocks = data.draw(st.integers(2, r.count - 1))
    coarse = coarsen(g, r, blocks)
    assert coarse is not None
    cg = coarse.graph  # the constructor checked it: names, references, order
    assert cg.n_ops == g.n_ops - (r.count - blocks) * r.period
    assert (coarse.source[g.saved] >= 0).all()
    # any decisions of the coarse graph, stretched, are valid decisions of the original ...
    coarse_codes = np.full(len(cg.tensors), -1, dtype=np.int8)
    for t in cg.saved:
        coarse_codes[t] = data.draw(
            st.sampled_from([KEEP, SWAP] + ([RECOMPUTE] if cg.can_recompute[t] else []))
        )
    mask = decision_mask(
        g,
        data.draw(
            st.sampled_from(
                [("keep", "swap", "recompute"), ("keep", "recompute"), ("keep", "swap")]
            )
        ),
    )
    codes = consistent(g, coarse.stretch(coarse_codes), mask)
    assert first_forbidden(g, codes, mask) is None
    assert set(codes[g.saved].tolist()) <= {KEEP, SWAP, RECOMPUTE}
    assert not (codes[g.saved] == -1).any()
    for members in g.rng_groups.values():
        assert len({int(codes[m] == RECOMPUTE) for m in members}) == 1
    assert all(g.can_recompute[t] for t in np.flatnonzero(codes == RECOMPUTE))
    # ... and, repaired to a budget that can be met, a plan the checker passes
    budget = int(max(ss.min_budget(g, LINK), 0.6 * keep_all_peak(g, LINK)))
    if fit_to_budget(g, LINK, budget, codes, mask):
        decisions = {
            g.tensors[int(t)].name: ("keep", "swap", "recompute")[int(codes[t])] for t in g.saved
        }
        plan = ss.complete(
            ss.Plan(
                graph_name=g.name, graph_digest=g.digest, budget_bytes=budget, decisions=decisions
            ),
            g,
            LINK,
        )
        assert ss.validate(g, plan, LINK).ok


@pytest.mark.slow
def test_exact_planner_starts_from_the_coarse_plan(monkeypatch):
    """A 40-layer GPT-style step with one layer's attention output pinned to keep: the coarse
    start (its threshold lowered so that a graph this small gets one; 8 of 40 layers) is used,
    the pin holds, the checker passes the plan, and it is no worse than the heuristic's."""
    from slackswap.planners.exact import start_search, warmstart

    # where each is read: the search asks for a coarse start, coarse_start makes it
    monkeypatch.setattr(start_search, "COARSE_MIN_OPS", 100)
    monkeypatch.setattr(warmstart, "COARSE_MIN_OPS", 100)
    monkeypatch.setattr(warmstart, "COARSE_MAX_OPS", 80)
    g = ss.transformer_graph(config(40), HW)
    pinned = "L20.attn.out"
    assert pinned in g.tensor_index
    plan = ss.solve(g, 0.4, HW, work_s=20, time_limit_s=CAP, pins={pinned: "keep"})
    coarse = plan.info.extra["coarse"]
    assert coarse["status"] == "used" and coarse["blocks"] == 8
    assert plan.decisions[pinned] == "keep"
    assert ss.validate(g, plan, HW).ok
    heuristic = ss.solve(g, 0.4, HW, solver="heuristic", pins={pinned: "keep"})
    assert plan.info.predicted_step_time_s <= heuristic.info.predicted_step_time_s * (1 + 1e-9)


def test_a_period_of_the_shapes_alone_gives_way_to_the_references():
    """Blocks of two ops of one shape (one input, one 1-byte output): the first reads a tensor
    of the prefix, the second the op before. In shape alone every op matches the next (period
    1, 27 ops); in references only every other one does: 13 blocks of 2 from k1 (ops 1-26)."""
    ops = [op("in", 1.0, 1.0, outputs=["in.0", "in.shared"])]
    tensors = [tensor("in.0", 5), tensor("in.shared", 3)]
    for k in range(1, 27):
        ops.append(
            op(
                f"k{k}",
                1.0,
                2.0,
                inputs=["in.shared" if k % 2 else f"k{k - 1}.0"],
                outputs=[f"k{k}.0"],
            )
        )
        tensors.append(tensor(f"k{k}.0", 1))
    ops.append(op("loss", 1.0, 1.0, inputs=["k26.0"], outputs=["loss.0"]))
    tensors.append(tensor("loss.0", 1))
    r = find_repeats(graph(ops, tensors, name="alternating"))
    assert r is not None and (r.start, r.period, r.count) == (1, 2, 13)
