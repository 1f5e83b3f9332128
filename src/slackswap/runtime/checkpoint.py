"""A plan as a torch selective-checkpoint policy (``torch.utils.checkpoint``)."""

from __future__ import annotations

from ..core.graph import ActivationGraph
from ..core.plan import Plan


def checkpoint_policy(plan: Plan, graph: ActivationGraph):
    """A torch.utils.checkpoint selective-checkpoint policy with ``plan``'s recomputes.

    Ops of ``graph`` that produce a saved tensor the plan keeps or offloads get MUST_SAVE;
    all others PREFER_RECOMPUTE: those whose tensors the plan recomputes, those whose outputs
    backward never reads (views, in-place ops, intermediates), and ops whose outputs are
    later written in place (a dropout mask drawn in place): torch must rerun those with the
    in-place op, so they get PREFER_RECOMPUTE too (checkpoint restores the RNG state). Calls are
    matched to the graph's ops in order, so checkpoint the same forward that was profiled (the
    whole model call); a call that does not match the graph's next op is saved; the graph's first
    op with no match ahead starts the next step. Use with ``create_selective_checkpoint_contexts``.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    plan.check_graph(graph)
    steps = []
    for i, op in enumerate(graph.ops):
        keeps = [graph.tensors[t].name for t in graph.op_outputs[i] if graph.is_saved[t]]
        recompute = not op.recomputable or not keeps or any(
            plan.decisions.get(name) == "recompute" for name in keeps)
        steps.append((str(op.extra.get("aten", "")), recompute))
    cursor = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        key = bool(getattr(ctx, "is_recompute", False))
        i = cursor[key]
        name = str(func)
        while i < len(steps) and steps[i][0] != name:
            i += 1
        if i >= len(steps):
            if name != steps[0][0]:
                return CheckpointPolicy.MUST_SAVE
            # the graph's first op again with no match ahead: a new step (the graph's tail,
            # the loss, ran outside the checkpointed call)
            i = 0
        cursor[key] = i + 1
        if cursor[key] >= len(steps):
            cursor[key] = 0
        return CheckpointPolicy.PREFER_RECOMPUTE if steps[i][1] else CheckpointPolicy.MUST_SAVE

    return policy
