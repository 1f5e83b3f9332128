"""Budgets as users type them: read, or refused at once with the forms that are read, wherever a
budget is given (solve, the loop, the trainers' hooks, the command line); "smallest" plans at
the smallest budget any plan reaches."""

import pytest
from helpers import graph, op, tensor

import slackswap as ss
from slackswap.cli import main
from slackswap.core.units import budget_bytes_from, check_budget


def peak():
    return 1000  # a keep-all peak for the fractions


@pytest.mark.parametrize(
    "text, expected",
    [
        ("40GB", 40 * 10**9),
        ("40 GiB", 40 * 2**30),
        ("4e10", 4 * 10**10),  # bytes in exponent form
        ("1.5e10", 15 * 10**9),
        ("5e-1", 500),  # a fraction in exponent form: 0.5 of 1000
        ("0.25", 250),
        ("50%", 500),
        ("123", 123),
    ],
)
def test_the_spellings_users_type_are_read(text, expected):
    assert budget_bytes_from(text, peak) == expected


@pytest.mark.parametrize("text, forms", [("40G", ("40GB", "40GiB")), ("512m", ("512MB", "512MiB"))])
def test_a_bare_letter_is_refused_naming_both_units(text, forms):
    with pytest.raises(ValueError, match="does not say which unit") as info:
        budget_bytes_from(text, peak)
    assert all(f in str(info.value) for f in forms)


def test_an_unreadable_budget_names_the_accepted_forms():
    with pytest.raises(ValueError, match="smallest") as info:
        check_budget("lots", "planned")
    assert str(info.value).startswith("planned: budget: cannot read 'lots'")
    assert check_budget("smallest", "planned") == "smallest"
    assert check_budget("40GB", "planned") == "40GB"  # (as given: nothing is altered)


def chain():
    """a (100 B) saved for op B, b (300 B) saved for C: with every decision allowed the
    smallest budget offloads both."""
    return graph(
        [
            op("A", 1e-3, 2e-3, [], ["a"]),
            op("B", 1e-3, 2e-3, ["a"], ["b"]),
            op("C", 1e-3, 2e-3, ["b"], ["c"]),
        ],
        [tensor("a", 100, ["B"]), tensor("b", 300, ["C"]), tensor("c", 10)],
    )


@pytest.mark.parametrize("allowed", [None, ("keep", "recompute")])
def test_solve_at_smallest_plans_at_the_smallest_budget(allowed):
    g = chain()
    hw = "a100-80gb-pcie4"
    plan = ss.solve(g, "smallest", hw, solver="heuristic", allowed=allowed)
    assert plan.budget_bytes == ss.min_budget(g, hw, allowed=allowed)
    assert ss.validate(g, plan).ok
    with pytest.raises(ss.InfeasibleBudget):
        ss.solve(g, plan.budget_bytes - 1, hw, solver="heuristic", allowed=allowed)


def test_the_command_line_refuses_a_budget_or_memory_as_it_reads_them(capsys):
    assert main(["solve", "bert-large", "--budget", "40G"]) == 2
    err = capsys.readouterr().err
    assert "40GB" in err and "40GiB" in err and "Traceback" not in err
    assert main(["fit", "gpt2", "--memory", "80G"]) == 2  # before any profile
    err = capsys.readouterr().err
    assert "--memory" in err and "80GB" in err


torch = pytest.importorskip("torch")


def test_the_loop_and_the_trainers_hooks_refuse_a_budget_when_made():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="planned: budget: cannot read 'lots'"):
        ss.planned(model, lambda y: y.sum(), "lots")
    with pytest.raises(ValueError, match="planned: unknown hardware 'tpu'"):
        ss.planned(model, lambda y: y.sum(), 0.5, "tpu")
    pytest.importorskip("lightning")
    from slackswap.lightning import SlackSwapCallback

    with pytest.raises(ValueError, match="SlackSwapCallback: budget: .*does not say which unit"):
        SlackSwapCallback(budget="40G")


@pytest.mark.slow
def test_a_loop_at_smallest_trains_as_plain_training_does():
    from models import TinyGPT

    torch.manual_seed(0)
    plain, looped = TinyGPT(d=32, p=0.0), TinyGPT(d=32, p=0.0)
    looped.load_state_dict(plain.state_dict())
    batches = [torch.randint(0, 50, (2, 16)) for _ in range(3)]

    def loss_fn(out):
        return out.logsumexp(-1).mean()

    for x in batches:
        loss_fn(plain(x)).backward()
    with ss.planned(looped, loss_fn, "smallest", refine_solver=None) as loop:
        for x in batches:
            loop.step(x)
        graph = loop.graph_for(batches[0])
        assert loop.last_plan.budget_bytes == ss.min_budget(graph, loop.last_plan.hardware)
    for p, q in zip(plain.parameters(), looped.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.slow
def test_an_infeasible_loop_budget_points_to_smallest():
    from models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(d=32, p=0.0)
    with ss.planned(model, lambda out: out.logsumexp(-1).mean(), 0.05, refine_solver=None) as loop:
        with pytest.raises(ss.InfeasibleBudget, match='budget="smallest"') as info:
            loop.step(torch.randint(0, 50, (2, 16)))
    assert info.value.min_budget_bytes > info.value.budget_bytes
