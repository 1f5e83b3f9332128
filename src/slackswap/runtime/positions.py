"""Where the executor acts, and what it did, as step positions (formulations/step-model.md,
"Positions and points": forward op i at i, the backward of op i at 2n-1-i).

``PlanPositions`` turns a closed plan's schedule into what the executor looks up while a step
runs (computed once per context): which swaps leave the device after which position, which
prefetches and rebuilds are due at which backward position, and the ops whose backward nodes
get a pre-hook so that the executor acts at those positions even where no saved tensor is read.

``RunLog`` is what a step did: every offload, release, prefetch, wait and rebuild with the
position it happened at. ``log.schedule`` is a ``Schedule`` of those positions (the plan's own
type), so a test can compare it with ``plan.schedule`` and ``replay`` runs it through the
simulator's rules.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..core.graph import ActivationGraph
from ..core.plan import Plan, Schedule

KINDS = ("offload", "release", "prefetch", "wait", "rebuild")


@dataclass
class RunLog:
    """Events of one step: (kind, tensor, position), in the order they happened."""

    events: list[tuple[str, str, int]] = field(default_factory=list)

    def add(self, kind: str, tensor: str, position: int) -> None:
        self.events.append((kind, tensor, position))

    def positions(self, kind: str) -> dict[str, int]:
        """Tensor -> the first position an event of ``kind`` happened at."""
        out: dict[str, int] = {}
        for k, tensor, position in self.events:
            if k == kind and tensor not in out:
                out[tensor] = position
        return out

    @property
    def schedule(self) -> Schedule:
        """The positions where the step released each swapped tensor's device memory, issued
        its prefetch, and rebuilt each recomputed tensor (its outermost rebuild)."""
        return Schedule(
            d2h_free=self.positions("release"),
            h2d_issue=self.positions("prefetch"),
            recompute_at=self.positions("rebuild"),
        )

    def replay(self, graph: ActivationGraph, plan: Plan):
        """The step as it ran, through the simulator's rules: the plan's decisions on the logged
        positions (a SimResult)."""
        from dataclasses import replace

        from ..check.simulate import simulate

        return simulate(graph, replace(plan, schedule=self.schedule))

    def to_dict(self) -> dict:
        return {"events": [list(e) for e in self.events], "schedule": self.schedule.to_dict()}


@dataclass(frozen=True)
class PlanPositions:
    """A closed plan's positions, as the executor looks them up."""

    n_ops: int
    release_after: dict[str, int]  # swap -> d2h_free
    issue_at: dict[int, tuple[str, ...]]  # position -> swaps whose prefetch is issued there
    rebuild_at: dict[int, tuple[str, ...]]  # position -> recomputed tensors rebuilt there
    hooked_ops: frozenset[int]  # ops whose backward node runs the events of its position
    issue_order: tuple[int, ...] = ()  # the positions of issue_at, in order
    # every position at whose start the plan does something (a release after the one before, a
    # prefetch, a rebuild), in order
    event_starts: tuple[int, ...] = ()

    @classmethod
    def of(cls, plan: Plan, graph: ActivationGraph) -> PlanPositions:
        n = graph.n_ops
        s = plan.schedule
        if s is None:
            raise ValueError(f"PlanPositions: plan for {plan.graph_name!r} has no schedule")
        issue: dict[int, list[str]] = defaultdict(list)
        for name, q in s.h2d_issue.items():
            issue[q].append(name)
        rebuild: dict[int, list[str]] = defaultdict(list)
        for name, q in s.recompute_at.items():
            rebuild[q].append(name)
        # a release after a backward position happens at the start of the next one
        backward = set(issue) | set(rebuild) | {q + 1 for q in s.d2h_free.values() if q >= n}
        if not graph.hooked_everywhere:
            # a profiled graph's hook positions are where a node unpacks a saved tensor, which
            # moves the step there already: a pre-hook only for a position that is not one
            at = graph.hook_positions
            backward = {q for q in backward if q < 2 * n and not at[q]}
        return cls(
            n_ops=n,
            release_after=dict(s.d2h_free),
            issue_at={q: tuple(v) for q, v in issue.items()},
            rebuild_at={q: tuple(v) for q, v in rebuild.items()},
            hooked_ops=frozenset(2 * n - 1 - q for q in backward if n <= q < 2 * n),
            issue_order=tuple(sorted(issue)),
            event_starts=tuple(
                sorted(set(issue) | set(rebuild) | {int(q) + 1 for q in s.d2h_free.values()})
            ),
        )

    def backward_position(self, op: int) -> int:
        return 2 * self.n_ops - 1 - op
