"""The checker's rules on a schedule's positions (formulations/step-model.md, "Decisions" and
"Hook positions"), each written from the text: where the executor may act, where a tensor is
rebuilt, when a swapped one leaves and comes back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .violation import Violation

if TYPE_CHECKING:
    from .walk import StepWalk


def check_hooks(
    walk: StepWalk,
    free_after: dict[int, int],
    issue_at: dict[int, int],
    rebuild_at: dict[int, int],
    out: list[Violation],
) -> None:
    """The executor acts only where a hook runs (step-model.md, "Hook positions"): a tensor
    leaves after a position followed by one, a prefetch and a rebuild start at one."""
    names = [t.name for t in walk.graph.tensors]
    S = 2 * walk.n
    for table, positions, after in (
        ("d2h_free", free_after, 1),
        ("h2d_issue", issue_at, 0),
        ("recompute_at", rebuild_at, 0),
    ):
        for t, position in positions.items():
            k = position + after
            if k < S and not walk.hooked_start[k]:
                out.append(
                    Violation(
                        "schedule",
                        f"schedule: {table}[{names[t]!r}] = {position}: no hook runs "
                        + ("after" if after else "at")
                        + f" position {position} ({walk.label(position)}), so the "
                        "executor cannot act there",
                        tensor=names[t],
                    )
                )


def check_rebuilds(
    walk: StepWalk, rebuild_at: dict[int, int], rebuilt: dict[int, int], out: list[Violation]
) -> None:
    """Each recompute_at is the backward position of the tensor's first use, and no later
    than its rebuilt_before."""
    g, n = walk.graph, walk.n
    names = [t.name for t in g.tensors]
    for t, position in rebuild_at.items():
        if position < n:
            out.append(
                Violation(
                    "schedule",
                    f"schedule: recompute_at[{names[t]!r}] = {position} is in the forward pass",
                    tensor=names[t],
                )
            )
        elif rebuilt.get(t) != position:
            out.append(
                Violation(
                    "schedule",
                    f"schedule: recompute_at[{names[t]!r}] = {position} is "
                    f"after its first use at position {rebuilt.get(t)} "
                    f"({walk.label(rebuilt.get(t, position))})",
                    tensor=names[t],
                )
            )
        latest = g.tensors[t].rebuilt_before
        if latest is not None and position > 2 * n - 1 - walk.op_of[latest]:
            # torch's checkpoint reruns the tensor's region before that op's backward: a plan
            # that holds it later would count less memory than the run holds
            out.append(
                Violation(
                    "schedule",
                    f"schedule: recompute_at[{names[t]!r}] = {position} is "
                    f"after its latest rebuild position, the backward of op "
                    f"{latest!r} (rebuilt_before)",
                    tensor=names[t],
                )
            )


def check_swaps(
    walk: StepWalk,
    free_after: dict[int, int],
    issue_at: dict[int, int],
    first_read: dict[int, int],
    out: list[Violation],
) -> None:
    """A swapped tensor leaves after its last forward reader, is prefetched after it has
    left, and no later than its first backward use."""
    names = [t.name for t in walk.graph.tensors]
    for t in free_after:
        if free_after[t] < walk.last_fwd[t]:
            out.append(
                Violation(
                    "schedule",
                    f"schedule: d2h_free[{names[t]!r}] = {free_after[t]} "
                    f"is before its last forward reader at position "
                    f"{walk.last_fwd[t]}",
                    tensor=names[t],
                )
            )
        if issue_at[t] <= free_after[t]:
            out.append(
                Violation(
                    "schedule",
                    f"schedule: tensor {names[t]!r} is prefetched at "
                    f"position {issue_at[t]}, before it has left (d2h_free "
                    f"{free_after[t]})",
                    tensor=names[t],
                )
            )
        if issue_at[t] > first_read[t]:
            out.append(
                Violation(
                    "schedule",
                    f"schedule: h2d_issue[{names[t]!r}] = {issue_at[t]} "
                    f"is after its first use at position {first_read[t]} "
                    f"({walk.label(first_read[t])})",
                    tensor=names[t],
                )
            )
