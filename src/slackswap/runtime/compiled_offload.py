"""A plan's swaps under torch.compile, through torch's own activation-offloading pass.

torch 2.13's partitioner can offload saved activations (``torch._functorch.config.
enable_activation_offloading``: ``_activation_offloading/activation_offloading.py``), but it acts
only on forward nodes marked ``should_offload``, which nothing sets: a selective-checkpoint
policy's ``CheckpointPolicy.MUST_CPU_OFFLOAD`` reaches the joint graph as the node's
``recompute`` tag and the partitioner treats it as neither save nor recompute. ``CompiledOffloads``
closes that gap while a ``checkpointed`` context is open:

- the region policy tags the node of each op whose saved output the plan swaps with the
  tensors' names (``tag``);
- a joint-graph pass (``torch._functorch.config.joint_custom_pass``) turns MUST_CPU_OFFLOAD into
  MUST_SAVE plus ``should_offload``, so the partitioner saves the tensor and torch's pass
  offloads it after the forward and reloads it for the backward;
- a wrapper around the pass reads what it did: the tagged nodes it offloaded and those it would
  not (a view, a getitem of a multi-output op, a non-contiguous tensor, a tensor not saved):
  ``report`` says which swaps ran as offloads and which were saved instead, and a
  RuntimeWarning names the latter when the graph is compiled.

The schedule is torch's, not the plan's: on CUDA the offload is issued on a transfer stream
after the producer and its wait sunk, the reload prefetched before the first use
(``activation_offload_separate_stream``, ``_sink_wait``, ``activation_reload_prefetch``); on
the CPU a synchronous ``device_put``.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import warnings
from typing import Any

OFFLOAD_PREFIX = "cpu_offload_"  # torch's names for the nodes its pass adds
RELOAD_PREFIX = "gpu_reload_"


class CompiledOffloads:
    """The swaps of one ``checkpointed`` context, as torch's offloading pass runs them."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.requested: set[str] = set()
        self.offloaded: set[str] = set()
        self.saved_instead: set[str] = set()
        self.recomputed_instead: set[str] = set()
        self.outside: set[str] = set()  # swaps in no region (saved from the start)
        self.graphs: list[dict[str, int]] = []  # per compiled graph: offload and reload nodes
        # per swapped tensor the compiled step does not save: the saved tensors computed from it
        # alone that it saves in its place (mark_stand_ins), by node name
        self.stand_ins: dict[str, list[str]] = {}
        self._stack: contextlib.ExitStack | None = None
        self._traced: dict[int, int] = {}  # per traced graph, its nodes before the next op's

    # ------------------------------------------------------------ tracing (the region policy)
    def tag(
        self,
        func,
        swaps: tuple[str, ...],
        op_output: Any = None,
        outputs: tuple[tuple[str, tuple[int, ...], bool], ...] = (),
    ) -> None:
        """Name the swapped tensors on the traced nodes of the op ``func`` just ran.

        Where the compiler decomposes the op (inductor: a layer norm becomes a dozen nodes, all
        tagged with the op's policy), the nodes of its outputs are found from ``op_output`` (the
        proxy of each output tensor) and matched to the profile's ``outputs`` by shape, in
        order: a swapped output's node carries its name (``slackswap_swaps``), another saved
        output's ``slackswap_output``, every other node the op traced ``slackswap_transient``
        (the joint pass saves and offloads, saves, or leaves to the partitioner to recompute
        them), but a random draw among them is saved (a recompute would draw again). Where no
        such match is made, the node whose target is ``func`` carries all the names (and every
        node of the op is saved and offloaded, as torch would)."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is None:
            return
        graph = mode.tracer.graph
        traced = list(graph.nodes)[self._traced.get(id(graph), 0) :]
        found = _output_nodes(mode, op_output, outputs)
        if found is not None and all(node in traced for node in found):
            for node, (name, saved) in found.items():
                if name in swaps:
                    node.meta["slackswap_swaps"] = (name,)
                elif saved:
                    node.meta["slackswap_output"] = True
            # the op's own node, where its outputs are getitems of it (not decomposed): saved
            # as before (the partitioner would recompute its getitems with it)
            producers = {
                node.args[0]
                for node in found
                if node.target is operator.getitem
                and node.args
                and getattr(node.args[0], "target", None) is func
            }
            for node in producers:
                node.meta["slackswap_output"] = True
            from .trace import RANDOM_OPS

            for node in traced:
                if node in producers:
                    continue
                if node not in found or not (found[node][0] in swaps or found[node][1]):
                    if any(word in str(node.target) for word in RANDOM_OPS):
                        # a draw inside the op is saved, never drawn again by a recompute
                        node.meta["slackswap_output"] = True
                    else:
                        node.meta["slackswap_transient"] = True
            return
        for node in itertools.islice(reversed(graph.nodes), 16):  # the newest
            if node.target is func:
                node.meta["slackswap_swaps"] = tuple(swaps)
                return

    def op_done(self) -> None:
        """The region policy decided an op under tracing: the nodes traced so far are no later
        op's (``tag`` takes the nodes after them as the next op's)."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        if mode is not None:
            self._traced[id(mode.tracer.graph)] = len(mode.tracer.graph.nodes)

    def ran_eagerly(self, swaps: tuple[str, ...]) -> None:
        """The region ran eagerly (no torch.compile, or a graph break in it): eager
        checkpointing has no offload, so these are saved; said once per context."""
        fresh = set(swaps) - self.saved_instead - self.offloaded
        if not fresh:
            return
        first = not (self.saved_instead - self.recomputed_instead - self.outside)
        self.saved_instead |= fresh
        if first:
            warnings.warn(
                f"checkpointed: a region with the plan's swaps ({sorted(fresh)[0]!r}, ...) ran "
                "eagerly (the model is not compiled, or torch.compile broke the graph inside the "
                "region): eager checkpointing cannot offload, so its swaps are saved on the "
                "device and the step holds more than the plan says; run the plan with "
                "slackswap.apply, or compile without graph breaks (checkpointed.info['swaps'])",
                RuntimeWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------ the partitioner's passes
    def joint_pass(self, previous):
        def mark(gm, inputs):
            from torch.utils.checkpoint import CheckpointPolicy

            offload = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)
            for node in gm.graph.nodes:
                if node.meta.get("recompute") in offload:
                    if node.meta.get("slackswap_output"):
                        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # (kept)
                    elif node.meta.get("slackswap_transient"):
                        # a node of the op that is none of its saved outputs: the partitioner
                        # recomputes it where backward needs it, as the plan's step would
                        node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                    else:
                        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                        node.meta["should_offload"] = True
            return previous(gm, inputs) if callable(previous) else gm

        return mark

    def wrap(self, original):
        def enable_activation_offloading(fwd_module, bwd_module, *args, **kwargs):
            self.stand_ins.update(mark_stand_ins(fwd_module))
            original(fwd_module, bwd_module, *args, **kwargs)
            self._read(fwd_module, bwd_module)

        return enable_activation_offloading

    def _read(self, fwd_module, bwd_module) -> None:
        offloaded: set[str] = set()
        tagged: set[str] = set()
        for node in fwd_module.graph.nodes:
            names = node.meta.get("slackswap_swaps") or node.meta.get("slackswap_stands_in_for")
            if names:
                tagged.update(names)
                if node.meta.get("saved_for_offloading"):
                    offloaded.update(names)
        self.offloaded |= offloaded
        refused = tagged - offloaded - self.offloaded
        self.saved_instead |= refused
        self.graphs.append(
            {
                "offloads": sum(n.name.startswith(OFFLOAD_PREFIX) for n in fwd_module.graph.nodes),
                "reloads": sum(n.name.startswith(RELOAD_PREFIX) for n in bwd_module.graph.nodes),
            }
        )
        if refused:
            shown = ", ".join(sorted(refused)[:4]) + (
                f" and {len(refused) - 4} more" if len(refused) > 4 else ""
            )
            warnings.warn(
                f"checkpointed: torch's offloading pass would not offload {len(refused)} of the "
                f"plan's swaps ({shown}: a view, a getitem of a multi-output op or a "
                "non-contiguous tensor); they are saved on the device instead, so the step holds "
                "more than the plan says (checkpointed.info['swaps'])",
                RuntimeWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------ the context
    def __enter__(self) -> CompiledOffloads:
        import torch._functorch._activation_offloading.activation_offloading as pass_module
        import torch._functorch.config as functorch_config

        stack = contextlib.ExitStack()
        stack.enter_context(
            functorch_config.patch(
                enable_activation_offloading=True,
                joint_custom_pass=self.joint_pass(functorch_config.joint_custom_pass),
                activation_offload_separate_stream=self.cuda,
                activation_offload_sink_wait=self.cuda,
                activation_reload_prefetch=self.cuda,
            )
        )
        original = pass_module.enable_activation_offloading
        pass_module.enable_activation_offloading = self.wrap(original)
        stack.callback(setattr, pass_module, "enable_activation_offloading", original)
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def report(self) -> dict[str, Any]:
        """Per swapped tensor of the plan, what ran: "offloaded" by torch's pass, "saved" (the
        pass would not offload it, or its op runs outside every checkpointed region),
        "recomputed" (torch's checkpoint reruns its op), or "not compiled" (no compiled graph
        took it up: a model compiled before the context, or a graph from a cache). A region
        that ran eagerly saved its swaps ("saved")."""
        out = {}
        for name in sorted(self.requested):
            out[name] = (
                "offloaded"
                if name in self.offloaded
                else "recomputed"
                if name in self.recomputed_instead
                else "saved"
                if name in self.saved_instead
                else "not compiled"
            )
        return out


def _output_nodes(mode, op_output: Any, outputs) -> dict | None:
    """The traced node of each output of an op that the profile named, with (name, saved): the
    op's output tensors matched to the profile's outputs by shape, in order within each shape.
    None where they do not match one to one (an output aliasing an input, symbolic shapes), or
    a tensor has no traced node."""
    import torch
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    if op_output is None or not outputs:
        return None
    tensors = [
        t
        for t in (op_output if isinstance(op_output, (tuple, list)) else [op_output])
        if isinstance(t, torch.Tensor)
    ]
    by_shape: dict[tuple[int, ...], list] = {}
    for t in tensors:
        try:
            shape = tuple(int(d) for d in t.shape)
        except (TypeError, RuntimeError):  # (a symbolic size)
            return None
        by_shape.setdefault(shape, []).append(t)
    named: dict[tuple[int, ...], list[tuple[str, bool]]] = {}
    for name, shape, saved in outputs:
        named.setdefault(tuple(shape), []).append((name, saved))
    if {s: len(v) for s, v in named.items()} != {s: len(v) for s, v in by_shape.items()}:
        return None
    found: dict = {}
    for shape, names in named.items():
        for t, entry in zip(by_shape[shape], names):
            if type(t).__name__ == "FunctionalTensor":
                t = torch._from_functional_tensor(t.elem)
            try:
                node = get_proxy_slot(t, mode.tracer).proxy.node
            except (AttributeError, KeyError, RuntimeError):
                return None
            if node in found:
                return None
            found[node] = entry
    return found


def mark_stand_ins(fwd_module) -> dict[str, list[str]]:
    """Mark for offloading what the compiled forward saves in a swapped tensor's place.

    The partitioner may save, instead of a tensor the plan swaps, tensors computed from it in
    the forward (inductor saves GELU's derivative, computed from the fc1 output, and drops the
    output itself). Such a tensor holds the swapped one's place: a saved output of the forward
    computed from one tagged node that is not saved itself, alone (every node it is computed
    from is that node, computed from it, a placeholder or a node of no inputs), that is not a
    tensor the plan keeps (the region policy's MUST_SAVE) nor a getitem (which torch's pass
    refuses), gets ``should_offload`` and the tagged node's names
    (``slackswap_stands_in_for``). Returns, per swapped tensor name, the nodes marked."""
    import operator

    from torch.utils.checkpoint import CheckpointPolicy

    graph = fwd_module.graph
    outputs = list(graph.find_nodes(op="output")[0].args[0])
    saved = [n for n in outputs if hasattr(n, "op") and n.op != "placeholder"]
    saved_set = set(saved)
    missing = [n for n in graph.nodes if n.meta.get("slackswap_swaps") and n not in saved_set]
    if not missing:
        return {}
    marked: dict[str, list[str]] = {}
    for source in missing:
        computed_from: set = {source}  # the source and every node computed from it
        for node in graph.nodes:  # (topological order)
            if node not in computed_from and any(
                arg in computed_from for arg in node.all_input_nodes
            ):
                computed_from.add(node)
        for out in saved:
            if (
                out not in computed_from
                or out.meta.get("slackswap_swaps")
                or out.target == operator.getitem
                or out.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
                or out.meta.get("slackswap_stands_in_for")
            ):
                continue
            if all(_from_source_alone(node, computed_from) for node in _ancestors(out, source)):
                names = tuple(source.meta["slackswap_swaps"])
                out.meta["should_offload"] = True
                out.meta["slackswap_stands_in_for"] = names
                for name in names:
                    marked.setdefault(name, []).append(out.name)
    return marked


def _ancestors(node, source) -> set:
    """Every node ``node`` is computed from, up to ``source`` (not what ``source`` is computed
    from)."""
    seen: set = set()
    stack = list(node.all_input_nodes)
    while stack:
        arg = stack.pop()
        if arg not in seen:
            seen.add(arg)
            if arg is not source:
                stack.extend(arg.all_input_nodes)
    return seen


def _from_source_alone(node, computed_from: set) -> bool:
    return node in computed_from or node.op == "placeholder" or not node.all_input_nodes
