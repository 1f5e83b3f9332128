"""Every kind of malformed graph is refused at load, with a message naming the culprit."""

import json
import math

import pytest
from helpers import graph, op, tensor

import slackswap as ss


def base():
    ops = [op("A", 1.0, 1.0, ["batch"], ["a"]), op("B", 1.0, 1.0, ["a"], ["b"])]
    tensors = [tensor("a", 100, ["B"]), tensor("b", 10, ["B"])]
    return ops, tensors


def as_dict(ops, tensors, **kw):
    d = {"format": "slackswap.graph/1", "name": "g", "ops": ops, "tensors": tensors}
    d.update(kw)
    return d


def test_valid_graph_loads_and_round_trips(tmp_path):
    ops, tensors = base()
    ops[0]["note"] = "kept"
    g = graph(ops, tensors)
    path = tmp_path / "g.json"
    path.write_text(g.to_json())
    again = ss.load_graph(path)
    assert again.digest == g.digest
    assert json.loads(again.to_json())["ops"][0]["note"] == "kept"  # unknown fields survive


def test_alive_until_extends_the_forward_life_and_round_trips():
    """A tensor the model holds past its last reader: its forward life ends at alive_until, the
    field survives JSON, and graphs without it keep their digest."""
    ops = [
        op("A", 1.0, 1.0, ["batch"], ["a"]),
        op("B", 1.0, 1.0, ["a"], ["b"]),
        op("C", 1.0, 1.0, ["b"], ["c"]),
    ]
    plain = graph(ops, [tensor("a", 100), tensor("b", 10, ["C"]), tensor("c", 1)])
    held = graph(
        ops, [dict(tensor("a", 100), alive_until="C"), tensor("b", 10, ["C"]), tensor("c", 1)]
    )
    assert plain.last_forward_use.tolist() == [1, 2, 2]  # a: last read by B
    assert held.last_forward_use.tolist() == [2, 2, 2]  # a: held until C
    assert held.digest != plain.digest
    again = ss.load_graph(json.loads(held.to_json()))
    assert again.tensors[0].alive_until == "C" and again.digest == held.digest
    # keep-all peak at C: a (100, held) + b (10, saved) + c (1) = 111, instead of 11
    cpu = ss.hardware("cpu")
    assert ss.keep_all_peak(plain, cpu) < ss.keep_all_peak(held, cpu) == 111


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (lambda o, t: o.reverse(), r"op 'B'.*reads tensor 'a' before it is produced"),
        (
            lambda o, t: o[0]["inputs"].append("b"),
            r"op 'A'.*reads tensor 'b' before it is produced.*cycle",
        ),
        (lambda o, t: t[0].update(saved_for=["Z"]), r"tensor 'a'.*saved_for names unknown op 'Z'"),
        (lambda o, t: t.append(tensor("orphan", 5)), r"tensor 'orphan'.*no op produces it"),
        (lambda o, t: o[1]["outputs"].append("ghost"), r"op 'B'.*output 'ghost' is not listed"),
        (lambda o, t: t[0].update(bytes=-1), r"tensor 'a'.*bytes must be a non-negative integer"),
        (lambda o, t: t[0].update(bytes=1.5), r"tensor 'a'.*bytes must be a non-negative integer"),
        (
            lambda o, t: t[0].update(bytes="100"),
            r"tensor 'a'.*bytes must be a non-negative integer",
        ),
        (lambda o, t: o[0].update(forward_s=math.nan), r"op 'A'.*forward_s must be finite"),
        (lambda o, t: o[1].update(backward_s=math.inf), r"op 'B'.*backward_s must be finite"),
        (lambda o, t: o[1].update(forward_s=-0.5), r"op 'B'.*forward_s must be finite and >= 0"),
        (lambda o, t: o.append(op("A", 1.0, 1.0)), r"op 'A'.*duplicate op name"),
        (lambda o, t: t.append(tensor("a", 3)), r"tensor 'a'.*duplicate tensor name"),
        (lambda o, t: o[0].update(forward_workspace_bytes=-3), r"op 'A'.*forward_workspace_bytes"),
        (
            lambda o, t: t[1].update(saved_for=["A"]),
            r"tensor 'b'.*names op 'A', which neither produces nor reads it",
        ),
        (
            lambda o, t: t[0].update(alive_until="Z"),
            r"tensor 'a'.*alive_until names unknown op 'Z'",
        ),
        (
            lambda o, t: t[1].update(alive_until="A"),
            r"tensor 'b'.*alive_until names op 'A', which runs before",
        ),
        (lambda o, t: t[0].update(alive_until=3), r"tensor 'a'.*alive_until must be an op name"),
    ],
)
def test_bad_graphs_are_refused(mutate, pattern):
    ops, tensors = base()
    mutate(ops, tensors)
    with pytest.raises(ss.GraphError, match=pattern):
        ss.load_graph(as_dict(ops, tensors))


def test_wrong_format_is_refused():
    ops, tensors = base()
    with pytest.raises(ss.GraphError, match="format"):
        ss.load_graph({**as_dict(ops, tensors), "format": "slackswap.graph/9"})


def test_missing_field_and_bad_json():
    ops, tensors = base()
    del ops[0]["forward_s"]
    with pytest.raises(ss.GraphError, match=r"op 'A'.*missing field 'forward_s'"):
        ss.load_graph(as_dict(ops, tensors))
    with pytest.raises(ss.GraphError, match="not valid JSON"):
        ss.load_graph("{not json")
    with pytest.raises(ss.GraphError, match="does not exist"):
        ss.load_graph("/nonexistent/graph.json")


def test_errors_are_value_errors():
    assert issubclass(ss.GraphError, ValueError)
    assert issubclass(ss.InfeasibleBudget, ValueError)


def test_bad_budgets():
    g = graph(*base())
    hw = "a100-80gb-pcie4"
    for bad in (0.0, 1.5, -3, "lots", True, float("nan")):
        with pytest.raises(ValueError, match="budget"):
            ss.parse_budget(bad, g, hw)
    assert ss.parse_budget("1KiB", g, hw) == 1024
    assert ss.parse_budget("50%", g, hw) == ss.parse_budget(0.5, g, hw)


def test_plan_for_another_graph_is_refused():
    g = graph(*base())
    ops, tensors = base()
    tensors[0]["bytes"] = 999
    other = graph(ops, tensors)
    plan = ss.solve(other, 1.0, "a100-80gb-pcie4", solver="keep-all")
    with pytest.raises(ss.PlanError, match="made for graph"):
        ss.simulate(g, plan, "a100-80gb-pcie4")
    assert not ss.validate(g, plan, "a100-80gb-pcie4").ok


def test_plan_missing_and_unknown_decisions():
    from helpers import plan as mk

    g = graph(*base())
    with pytest.raises(ss.PlanError, match="no decision for saved tensor"):
        ss.simulate(g, mk(g, {"a": "keep"}, 1000), "a100-80gb-pcie4")
    with pytest.raises(ss.PlanError, match="'zzz' is not in graph"):
        ss.simulate(g, mk(g, {"a": "keep", "b": "keep", "zzz": "keep"}, 1000), "a100-80gb-pcie4")
    with pytest.raises(ss.PlanError, match="decision 'drop'"):
        mk(g, {"a": "drop", "b": "keep"}, 1000)


def test_impossible_budget_raises_with_min_budget():
    g = graph(*base())
    with pytest.raises(ss.InfeasibleBudget) as info:
        ss.solve(g, 50, "a100-80gb-pcie4", solver="swap-all")
    # a (100) and b (10) are both read by B's forward and backward: 110 bytes at least
    assert info.value.min_budget_bytes == 110
