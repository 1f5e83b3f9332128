"""One plan for every rank of a torch.distributed job (FSDP2, DDP, or both).

Ranks with the same shapes run the same step, so they get the same graph and the same plan:
every rank profiles (its own timings), the op times are reduced to their median over the ranks,
rank 0 solves, the plan is broadcast, and every rank checks the plan's graph digest against its
own graph before the first step. Only torch.distributed's own object collectives are used
(``all_gather_object``, ``broadcast_object_list``), so the same code runs on gloo and nccl.

Every failure is agreed on before anyone raises: a rank whose profile fails, or whose graph
differs (another batch size, other shapes), makes every rank raise the same error naming it,
instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np

from .core.complete import load_plan
from .core.errors import PlanError
from .core.graph import ActivationGraph
from .core.hardware import Hardware
from .core.plan import Plan


class RankError(RuntimeError):
    """Raised on every rank when one rank cannot take part in the plan (named in the message)."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def _structure(graph: ActivationGraph) -> tuple[list, list]:
    """What must agree across ranks: every op and tensor, less the measured times."""
    return (
        [(o.name, o.inputs, o.outputs, o.recomputable, o.unit, o.param_unit) for o in graph.ops],
        [(t.name, t.bytes, t.saved_for, t.group) for t in graph.tensors],
    )


_OP_FIELDS = ("inputs", "outputs", "recomputable", "unit", "param_unit")
_TENSOR_FIELDS = ("bytes", "saved_for", "group")


def _first_difference(mine: list, theirs: list) -> str:
    """The first op or tensor where two structures differ, and how, in words."""
    for kind, fields, a_items, b_items in (
        ("op", _OP_FIELDS, mine[0], theirs[0]),
        ("tensor", _TENSOR_FIELDS, mine[1], theirs[1]),
    ):
        for a, b in zip(a_items, b_items):
            if a == b:
                continue
            if a[0] != b[0]:
                return f"{kind} {a[0]!r} on rank 0 is {b[0]!r} there"
            field = next(f for f, x, y in zip(fields, a[1:], b[1:]) if x != y)
            x, y = a[1 + fields.index(field)], b[1 + fields.index(field)]
            return f"{kind} {a[0]!r}: {field} {x!r} on rank 0, {y!r} there"
        if len(a_items) != len(b_items):
            return f"{len(a_items)} {kind}s on rank 0, {len(b_items)} there"
    return "the graphs differ"


def agree_on_graph(
    graph: ActivationGraph | None, error: str | None = None, group: Any = None
) -> ActivationGraph:
    """Every rank's graph, checked equal in structure, with each op's forward and backward time
    the median over the ranks (robust to one slow or noisy rank; the same value on every rank).
    ``error``: this rank could not profile (every rank then raises, naming it)."""
    import torch.distributed as dist

    from .runtime.overhead import with_overhead, without_overhead

    world = dist.get_world_size(group)
    # each rank measured its own overhead (runtime/overhead.py): the largest counts on all
    overhead = dict(graph.extra.get("overhead", {})) if graph is not None else {}
    if graph is not None:
        graph = without_overhead(graph)
    mine = (
        None
        if graph is None
        else {
            "overhead": [int(overhead.get("bytes", 0)), int(overhead.get("plain_peak_bytes", 0))],
            "structure": _structure(graph),
            "alive_until": [t.alive_until for t in graph.tensors],
            "forward_s": graph.forward_s.tolist(),
            "backward_s": graph.backward_s.tolist(),
            "optimizer_s": graph.optimizer_s,
        }
    )
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"error": error, "graph": mine}, group=group)
    failed = [
        (rank, item["error"] or "no graph")
        for rank, item in enumerate(gathered)
        if item["error"] is not None or item["graph"] is None
    ]
    if failed:
        # every failure is named: one rank's own error often makes the others' collectives fail
        raise RankError(
            "; ".join(f"rank {rank} could not profile its step: {why}" for rank, why in failed),
            failed[0][0],
        )
    assert graph is not None  # (a rank without a graph is named in ``failed``)
    reference = gathered[0]["graph"]["structure"]
    for rank, item in enumerate(gathered[1:], start=1):
        if item["graph"]["structure"] != reference:
            raise RankError(
                f"rank {rank} traced another step than rank 0 (uneven batch or other "
                f"shapes?): {_first_difference(reference, item['graph']['structure'])}"
                "; every rank must run the same shapes to share one plan",
                rank,
            )
    fwd = np.median([item["graph"]["forward_s"] for item in gathered], axis=0)
    bwd = np.median([item["graph"]["backward_s"] for item in gathered], axis=0)
    opt = float(np.median([item["graph"]["optimizer_s"] for item in gathered]))
    ops = tuple(
        replace(op, forward_s=float(f), backward_s=float(b))
        for op, f, b in zip(graph.ops, fwd, bwd)
    )
    # how long the model holds a tensor is observed, and a rank's own work (DDP's buffer
    # broadcast differs on the source rank) can hold one longer: the latest any rank saw
    position = {op.name: i for i, op in enumerate(graph.ops)}
    tensors = []
    for j, t in enumerate(graph.tensors):
        seen = [item["graph"]["alive_until"][j] for item in gathered]
        named = [x for x in seen if x is not None]  # None: freed after its last reader
        latest = max(named, key=position.__getitem__) if named else None
        tensors.append(t if latest == t.alive_until else replace(t, alive_until=latest))
    extra = {
        **graph.extra,
        "ranks": world,
        "times": "median over ranks",
        "lifetimes": "latest over ranks",
    }
    agreed = ActivationGraph(
        name=graph.name,
        ops=ops,
        tensors=tuple(tensors),
        optimizer_s=opt,
        extra=extra,
        collectives=graph.collectives,
    )
    if not overhead:  # not measured (FSDP2, a fake profile, overhead=False)
        return agreed
    largest = max((item["graph"]["overhead"] for item in gathered), key=lambda o: o[0])
    return with_overhead(agreed, *largest)


def share_plan(graph: ActivationGraph, make_plan, group: Any = None) -> Plan:
    """``make_plan()`` on rank 0, broadcast; every rank checks the plan is for its graph (by
    digest) and all ranks agree before it is returned. A failure anywhere raises everywhere."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    payload: list = [None]
    if rank == 0:
        try:
            payload[0] = {"plan": make_plan().to_json(), "error": None}
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
            payload[0] = {"plan": None, "error": f"{type(exc).__name__}: {exc}"}
    dist.broadcast_object_list(payload, src=0, group=group)
    if payload[0]["error"] is not None:
        raise RankError(f"rank 0 could not plan: {payload[0]['error']}", 0)
    plan = load_plan(json.loads(payload[0]["plan"]))
    ok = plan.graph_digest == graph.digest
    verdicts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, ok, group=group)
    bad = [r for r, v in enumerate(verdicts) if not v]
    if bad:
        raise RankError(
            f"the plan's graph digest does not match the graph of rank(s) {bad}", bad[0]
        )
    return plan


def plan_for_ranks(
    model,
    inputs,
    loss_fn,
    budget,
    hardware: Hardware | str | None = None,
    *,
    solver: str = "heuristic",
    time_limit_s: float | None = None,
    group: Any = None,
    profile_options: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    **solve_options: Any,
) -> tuple[ActivationGraph, Plan]:
    """Profile ``model`` on every rank, agree on one graph (median times), solve on rank 0 and
    share the plan: (graph, plan), the same on every rank. Call it on every rank, like any
    collective, with the model already wrapped (``fully_shard``, ``DistributedDataParallel``).

    slackswap's own collectives run on a gloo group of their own with ``timeout_s``: a rank that
    never arrives (late, or stuck in a wrapper's collective after another rank's forward raised)
    makes the others raise a RankError naming it after that long instead of waiting forever, and
    a rank that arrives after the others gave up raises the same error at once (each rank notes
    its arrival at each collective in torch.distributed's own store).

    Args:
        model: the (DDP or FSDP2) module on this rank.
        inputs: this rank's batch (every rank the same shapes).
        loss_fn: the loss of the output.
        budget: as for ``solve``.
        hardware: the device.
        solver, time_limit_s: as for ``solve``.
        group: the process group (default: a new gloo group for planning).
        profile_options: passed to ``profile``.
        timeout_s: how long a rank waits for the others at each phase.
        solve_options: passed to ``solve``.

    Returns:
        (graph, plan), the same on every rank.

    Raises:
        RankError: a rank could not profile or plan, or traced another step (named).
    """
    import datetime

    import torch.distributed as dist

    arrivals = _Arrivals(timeout_s)
    own = group is None
    if own:
        group = arrivals.phase(
            "the planning group's creation",
            lambda: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)),
        )
    try:
        return _plan_for_ranks(
            model,
            inputs,
            loss_fn,
            budget,
            hardware,
            solver,
            time_limit_s,
            group,
            profile_options,
            solve_options,
            arrivals,
        )
    finally:
        if own:
            dist.destroy_process_group(group)


_CALLS = __import__("itertools").count()


class _Arrivals:
    """Which ranks reached which of slackswap's collectives, in the default store: a collective
    that times out is blamed on the ranks that never arrived."""

    def __init__(self, timeout_s: float):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.prefix = f"slackswap/plan_for_ranks/{next(_CALLS)}"
        self.store = _get_default_store()

    def _given_up(self) -> None:
        """Raise what the others raised if they gave up before this rank arrived (the store is
        gone too when rank 0, its host, has exited since)."""
        key = f"{self.prefix}/failed"
        try:
            failed = self.store.check([key])
            failure = json.loads(self.store.get(key).decode()) if failed else None
        except RuntimeError as exc:  # torch's DistNetworkError and DistStoreError among them
            raise RankError(
                f"rank {self.rank} did not reach slackswap's planning before the "
                f"other ranks gave up: the store is gone ({type(exc).__name__})",
                self.rank,
            ) from exc
        if failure is not None:
            raise RankError(failure["message"], failure["rank"])

    def phase(self, name: str, run):
        """``run()``, every rank noting its arrival first; a timeout becomes a RankError."""
        self._given_up()
        self.store.set(f"{self.prefix}/{name}/{self.rank}", "1")
        try:
            return run()
        except RankError:
            raise
        except Exception as exc:
            missing = [
                r for r in range(self.world) if not self.store.check([f"{self.prefix}/{name}/{r}"])
            ]
            if not missing:
                raise
            message = (
                (f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}")
                + f" did not reach {name} within {self.timeout_s:g} s (late, or stuck in another "
                "collective); every rank must call plan_for_ranks together"
            )
            self.store.set(
                f"{self.prefix}/failed", json.dumps({"message": message, "rank": missing[0]})
            )
            raise RankError(message, missing[0]) from exc


def _plan_for_ranks(
    model,
    inputs,
    loss_fn,
    budget,
    hardware,
    solver,
    time_limit_s,
    group,
    profile_options,
    solve_options,
    arrivals: _Arrivals,
) -> tuple[ActivationGraph, Plan]:
    from .runtime.profiler import profile
    from .solve import solve

    graph, error = None, None
    try:
        graph = profile(model, inputs, loss_fn, **(profile_options or {}))
    except Exception as exc:  # noqa: BLE001 - agreed on first, then raised on every rank
        error = f"{type(exc).__name__}: {exc}"
    shared = arrivals.phase(
        "the graphs' exchange", lambda: agree_on_graph(graph, error, group=group)
    )
    hw = {} if hardware is None else {"hardware": hardware}
    plan = arrivals.phase(
        "the plan's exchange",
        lambda: share_plan(
            shared,
            lambda: solve(
                shared, budget, solver=solver, time_limit_s=time_limit_s, **hw, **solve_options
            ),
            group=group,
        ),
    )
    if plan.hardware is None:
        raise PlanError("the shared plan carries no hardware")
    return shared, plan
