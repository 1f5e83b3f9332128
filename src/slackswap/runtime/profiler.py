"""profile(): real torch training steps become an ActivationGraph.

Every tensor autograd saves for backward is found with saved-tensor hooks, attributed to the op
whose autograd node saved it (by autograd sequence number), deduplicated by storage (views map to
their base; parameters, buffers and the batch are left out). Forward times are measured around
each aten op, backward times around each autograd node; medians over ``repeat`` steps after
``warmup``. torch is imported here and in the executor only.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..core.errors import ProfileError
from ..core.graph import ActivationGraph
from ..core.hardware import Hardware, hardware
from .fsdp_collectives import fsdp_collectives
from .link import calibrate_link
from .model_state import OPTIMIZERS, PRECISIONS, check_precision, with_model_state
from .overhead import measured_overhead_bytes, with_overhead
from .plain_step import (
    call_model,
    fresh_autocast,
    metered_plain_step,
    parameters_cast,
    plain_phase_times,
    scaled_to_plain,
    under_autocast,
    with_inputs_cast,
    with_parameter_gradients,
)
from .step import held_as_saved, unchanged_since_saved
from .traced_graph import graph_from_traces
from .traced_graph import group_by_module as _group

_preset = hardware  # profile() takes a ``hardware`` argument


def _user_failure(message: str, exc: BaseException) -> ProfileError:
    error = ProfileError(message)
    error.user_error = exc
    return error


def _to(inputs, device):
    import torch

    if device is None:
        return inputs
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, tuple):
        return tuple(_to(x, device) for x in inputs)
    if isinstance(inputs, dict):
        return {k: _to(v, device) for k, v in inputs.items()}
    return inputs


def run_traced_step(
    model,
    inputs,
    loss_fn,
    sync=None,
    keep_calls=False,
    untouched: Untouched | None = None,
    cost=None,
    forward=None,
    *,
    values=None,
):
    """One forward + backward under the tracer; returns the StepTrace. ``untouched``: what the
    step writes that plain training owns (gradients of every leaf backward reaches, state the
    forward writes) is recorded there first, to be put back (Untouched.restore). ``cost``: a
    fake step's op times (runtime/costmodel.py), in place of the clock."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from .backward_trace import time_backward
    from .trace import GpuClock, ModulePaths, Tracer

    fresh_autocast()
    paths = ModulePaths(model)
    # on a GPU, times come from CUDA events (no synchronisation per op)
    clock = GpuClock() if sync is not None and cost is None else None
    tracer = Tracer(
        model,
        paths,
        keep_calls=keep_calls,
        sync=sync,
        observe_lifetimes=True,
        # a fake step has no values to compare: state writes are known by the
        # ops' schemas and trace.UNMARKED_WRITERS alone
        clock=clock,
        watch_state=cost is None,
        originals=None if untouched is None else untouched.state,
        cost=cost,
        fake=cost is not None,
        values=values,
    )
    saved: list[tuple[int, str]] = []

    pack_after = tracer.trace.pack_after

    def pack(t):
        pack_after.add(len(tracer.trace.ops) - 1)
        name = tracer.tensor_name(t)
        if name is not None:
            saved.append((torch._C._autograd._get_sequence_nr() - 1, name))
            # autograd holds an alias (made outside the trace), so the model's own tensor object
            # dies when the model drops it: that is when a plan that does not keep it can free it
            with _disable_current_modes():
                return held_as_saved(t.detach())  # (an alias shares the version counter)
        return held_as_saved(t)

    # Python's cyclic collector runs when its allocation counters say, not where the model lets
    # go of an object: a tensor held by a reference cycle would die at a different op on every
    # run and every rank. Off while tracing, such a tensor lives to the end of the forward (the
    # longest it can), the same on every run.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unchanged_since_saved), tracer:
            try:
                out = (forward or call_model)(model, inputs)
            except ProfileError:
                raise
            except Exception as exc:
                raise _user_failure(
                    f"the model failed to run on the inputs: {type(exc).__name__}: {exc}", exc
                ) from exc
            try:
                loss = loss_fn(out)
            except Exception as exc:
                raise _user_failure(
                    f"loss_fn failed on the model's output: {type(exc).__name__}: {exc}", exc
                ) from exc
    finally:
        paths.remove()
        if collecting:
            gc.enable()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ProfileError(f"loss_fn must return a scalar tensor, got {shape}")
    if not loss.requires_grad:
        raise ProfileError(
            "the loss does not require grad: the model's output has no autograd "
            "history (all parameters frozen, or run under torch.no_grad?)"
        )
    trace = tracer.trace
    trace.saved = saved
    if untouched is not None:
        untouched.take_gradients(loss)
    time_backward(loss, trace, sync, clock, cost)
    if clock is not None:
        clock.resolve(trace)
    return trace


def profile(
    model,
    inputs,
    loss_fn: Callable,
    device=None,
    *,
    warmup: int = 1,
    repeat: int = 3,
    name: str | None = None,
    group_by_module: bool = False,
    calibrate: bool = True,
    gradients: str = "auto",
    fake: bool = False,
    hardware: Hardware | str | None = None,
    optimizer: str = "adamw",
    foreach: bool | None = None,
    forward: Callable | None = None,
    overhead: bool = True,
    precision: str = "pure",
) -> ActivationGraph:
    """Profile ``warmup + repeat`` training steps of ``model`` and return its activation graph.

    inputs: a tensor, a tuple (positional arguments) or a dict (keyword arguments).
    loss_fn(output) -> scalar loss. device: move model and inputs there first (None: leave them).
    group_by_module: one op per module call instead of per aten op (a coarser, faster-to-plan
    graph with the same tensors). What the steps write that training owns is put back as it
    was: the gradient of every tensor backward reaches (parameters of the model or not, a head
    or a temperature the loss function holds) and the state the forward writes (batch norm's
    statistics, buffers, tensors the loss function updates), with every random stream the
    forward can draw from and every attribute or buffer it rebinds (runtime/training_state.py):
    training after a profile is training without it.

    calibrate: time ``repeat`` plain steps too (no tracer) and scale the forward and backward op
    times so that each phase sums to its measured plain time (the tracer's own host time, and
    the Python work between ops that no op is charged for, would otherwise put the ideal step
    30% off the step it measures); ``graph.extra["timing"]`` keeps both sums.

    gradients: "made" (training with torch's ``zero_grad()``, which sets them to None so each
    step makes them) counts in each op's backward the parameter gradients made before it in the
    step; "held" (they exist before the step, training accumulates in place,
    ``zero_grad(set_to_none=False)``) leaves them out, as does a model sharded with FSDP2.
    "auto" (the default): "made" unless a trainable parameter has a gradient when the profile
    starts (``graph.extra["parameter_gradients"]`` says which). No plan moves them: on small
    models "made" sets the smallest budget.

    fake: trace one step under torch's FakeTensorMode instead (runtime/fake.py): no tensor
    memory, so a model built on the ``meta`` device profiles at any size; the graph's structure
    is the real step's on that device, its op times the cost model's for ``hardware``
    (runtime/costmodel.py; required with ``fake``), named in ``graph.extra["times"]``.

    optimizer: whose state ``graph.extra["model_state"]`` counts beside the parameters and
    their gradients, and its step's temporaries (runtime/model_state.py), for :func:`slackswap.fit`;
    ``foreach`` as the optimizer is made (None: torch's default, multi-tensor on CUDA).
    precision: the regime the step trains in (runtime/model_state.py ``PRECISIONS``): "pure"
    (the default, torch's: parameters, gradients and optimizer state in the model's dtype) or
    "mixed" / "mixed-fp16" (float32 master parameters, float32 gradients and moments, the forward
    under ``torch.autocast`` in bf16 / fp16, as HF's ``bf16=True`` and Lightning's "bf16-mixed").

    forward: ``forward(model, inputs)`` in place of calling the model on the inputs (a trainer's
    own loss computation, which calls the model inside it); ``loss_fn`` gets what it returns.

    overhead: measure two plain steps' peaks (``StepMeter``) against the graph's keep-all
    simulation and count what is above in every op's workspaces (runtime/overhead.py: on the
    CPU heap, autograd's records of the graph; ``graph.extra["overhead"]``), so that a plan's
    budget covers what the step holds beside its tensors. False: the graph's tensors and
    workspaces alone (graphs compared tensor by tensor). Not with FSDP2 (no single device's
    step to measure) or ``fake``.

    Args:
        model: the torch module.
        inputs: its inputs.
        loss_fn: the loss of its output.
        device: where to move the model and inputs first.
        (every other option as above)

    Returns:
        The graph of one training step.

    Raises:
        ProfileError: a model, inputs, loss or option that cannot be profiled (``user_error``:
            the user's own exception, if that is why).
    """
    import torch

    _check_options(fake=fake, optimizer=optimizer, gradients=gradients, precision=precision)
    if not isinstance(model, torch.nn.Module):
        raise ProfileError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_precision(model, precision)
    gradients, forward, cast = _in_regime(model, precision, gradients, forward)
    if fake:
        with cast(model):
            graph = _profile_fake(
                model, inputs, loss_fn, device, name, gradients, hardware, forward
            )
        # the model's own parameters (the masters), not the cast ones the step ran on
        graph = replace(graph, extra={**graph.extra, "parameters": model_parameters(model)})
        graph = with_model_state(graph, model, optimizer, foreach, precision)
        return _group(graph) if group_by_module else graph
    _check_options(calibrate=calibrate, overhead=overhead, gradients=gradients)
    if repeat < 1 or warmup < 0:
        raise ProfileError("repeat must be >= 1 and warmup >= 0")
    model, inputs = _on_device(model, inputs, device)
    with cast(model):
        graph = _measured_graph(
            model,
            inputs,
            loss_fn,
            device,
            warmup=warmup,
            repeat=repeat,
            name=name,
            calibrate=calibrate,
            gradients=gradients,
            forward=forward,
            overhead=overhead,
        )
    # the model's own parameters (the masters), not the cast ones the step ran on
    graph = replace(graph, extra={**graph.extra, "parameters": model_parameters(model)})
    graph = with_model_state(graph, model, optimizer, foreach, precision)
    return _group(graph) if group_by_module else graph


def _on_device(model, inputs, device):
    """The eager model behind a torch.compile'd one (the same parameters and saved tensors; the
    plan then runs with slackswap.checkpointed around the compiled one), model and inputs moved
    to ``device`` where one is given."""
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        model = model._orig_mod
    if device is not None:
        model = model.to(device)
        inputs = _to(inputs, device)
    return model, inputs


def _check_options(**options) -> None:
    """profile()'s switches are True or False and its choices one of theirs: a truthy string
    like "False" would otherwise turn one on."""
    for name, value in options.items():
        if name in ("fake", "calibrate", "overhead") and not isinstance(value, bool):
            raise ProfileError(f"{name} must be True or False, got {value!r}")
    if "optimizer" in options and options["optimizer"] not in OPTIMIZERS:
        raise ProfileError(
            f"optimizer must be one of {sorted(OPTIMIZERS)}, got {options['optimizer']!r}"
        )
    if "gradients" in options and options["gradients"] not in GRADIENTS:
        raise ProfileError(f"gradients must be one of {GRADIENTS}, got {options['gradients']!r}")
    if "precision" in options and options["precision"] not in PRECISIONS:
        raise ProfileError(
            f"precision must be one of {sorted(PRECISIONS)}, got {options['precision']!r}"
        )


def _in_regime(
    model, precision: str, gradients: str, forward: Callable | None
) -> tuple[str, Callable | None, Callable[[Any], Any]]:
    """The step as ``precision`` trains it: (gradients, the forward, a context manager of the
    model to profile it in). Autocast wraps the forward; FSDP2's MixedPrecisionPolicy runs it on
    parameters cast as it gathers them (unless FSDP2 wraps the model, which casts them itself),
    its gradients shards held beside the step."""
    regime = PRECISIONS[precision]
    cast: Callable[[Any], Any] = lambda _: contextlib.nullcontext()  # noqa: E731
    if regime.gathered_dtype is not None:
        gradients = _sharded_gradients(gradients, precision)
        if not is_sharded(model):
            forward = with_inputs_cast(forward, regime.gathered_dtype)
            dtype = regime.gathered_dtype
            cast = lambda m: parameters_cast(m, dtype)  # noqa: E731
    gradients = gradients_of(model) if gradients == "auto" else gradients
    if regime.autocast and regime.compute_dtype is not None:
        forward = under_autocast(forward, regime.compute_dtype)
    return gradients, forward, cast


def _sharded_gradients(gradients: str, precision: str) -> str:
    """Under FSDP2 a unit's gradients are reduce-scattered into shards and the unsharded ones
    freed as its backward ends: the shards are held beside the step ("held"), never whole
    gradients made in backward."""
    if gradients == "made":
        raise ProfileError(
            f"precision={precision!r}: FSDP2 reduce-scatters each unit's gradients into shards "
            "held beside the step; gradients='made' counts whole ones in backward (use 'held' "
            "or 'auto')"
        )
    return "held"


def is_sharded(model) -> bool:
    """Whether FSDP2 (``fully_shard``) wraps the model or one of its modules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _measured_graph(
    model,
    inputs,
    loss_fn: Callable,
    device,
    *,
    warmup: int,
    repeat: int,
    name: str | None,
    calibrate: bool,
    gradients: str,
    forward: Callable | None,
    overhead: bool,
) -> ActivationGraph:
    """The traced steps as a graph: op times scaled to plain steps (``calibrate``), the link
    measured (CUDA), FSDP2's collectives, parameter gradients as ``gradients`` says, and what the
    step holds beside its tensors (``overhead``); what the steps wrote that training owns is put
    back."""
    import torch

    dev = (
        device
        if device is not None
        else next((p.device for p in model.parameters()), torch.device("cpu"))
    )
    dev = torch.device(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    from .training_state import TrainingState

    traces = []
    untouched = Untouched()
    state = TrainingState(model)
    plain = None
    try:
        for step in range(warmup + repeat):
            trace = run_traced_step(
                model, inputs, loss_fn, sync=sync, untouched=untouched, forward=forward
            )
            if step >= warmup:
                traces.append(trace)
        if calibrate:
            plain = plain_phase_times(model, inputs, loss_fn, sync, repeat, forward)
        # the device and link the graph was profiled on (measured on CUDA): solve() plans for
        # it unless told otherwise
        link = calibrate_link(dev) if dev.type == "cuda" else _preset("cpu")
        graph = graph_from_traces(
            traces,
            name or type(model).__name__,
            {
                "source": "slackswap.profile",
                "device": str(dev),
                "torch": torch.__version__,
                "repeat": repeat,
                "hardware": link.to_dict(),
                "parameters": model_parameters(model),
                "inputs": input_shapes(inputs),
            },
        )
        if plain is not None:
            graph = scaled_to_plain(graph, *plain)
        collectives = fsdp_collectives(model, graph)
        # under FSDP2 a unit's gradients are reduce-scattered and freed as its backward ends:
        # the step holds shards, not whole gradients, so they are left out there
        gradients = "held" if collectives else gradients
        graph = with_parameter_gradients(graph, gradients)
        if collectives:
            graph = replace(graph, collectives=collectives)
        elif overhead:
            # what the plain step holds beside the graph's tensors (runtime/overhead.py)
            graph = with_overhead(
                graph,
                *measured_overhead_bytes(
                    graph,
                    lambda sample: metered_plain_step(
                        model, inputs, loss_fn, dev, gradients, forward, sample
                    ),
                ),
            )
    finally:
        untouched.restore()
        state.restore()
        fresh_autocast()  # the step that follows makes its casts, as a step in a region does
    return graph


GRADIENTS = ("auto", "made", "held")


def gradients_of(model) -> str:
    """How the step that follows treats parameter gradients, from their state now: "held" when
    a trainable parameter has one (training accumulates into gradients kept across steps),
    "made" when none has (torch's ``zero_grad()`` sets them to None: each step makes them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return "held" if any(p.grad is not None for p in params) else "made"


def _profile_fake(
    model, inputs, loss_fn, device, name, gradients, hw, forward=None
) -> ActivationGraph:
    """One step under FakeTensorMode, timed by the cost model (runtime/fake.py)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .costmodel import CostModel
    from .fake import (
        InputValues,
        fake_device,
        fake_inputs,
        fake_model,
        fused_attention,
        values_read,
    )

    if hw is None:
        raise ProfileError(
            "profile(fake=True) needs hardware=...: a fake step runs no kernel, "
            "its op times come from the cost model for that device"
        )
    hw = hardware(hw)
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        model = model._orig_mod
    dev = fake_device(model, inputs, device)
    cost = CostModel(hw)
    # real tensors the model holds outside its parameters and buffers (constants) enter as fakes
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # faked for a GPU, attention runs as the GPU's fused kernel; for the CPU, as the CPU runs it
    fused = not hw.host_is_device
    with (
        fake_model(model, mode, dev),
        torch.random.fork_rng(devices=[]),
        fused_attention() if fused else contextlib.nullcontext(),
    ):
        args = fake_inputs(inputs, mode, dev)
        values = InputValues()
        values.inputs(args, inputs)
        untouched = Untouched()
        try:
            with mode, values_read(values):
                trace = run_traced_step(
                    model, args, loss_fn, untouched=untouched, cost=cost, forward=forward,
                    values=values,
                )  # fmt: skip
        finally:
            untouched.restore()
    graph = graph_from_traces(
        [trace],
        name or type(model).__name__,
        {
            "source": "slackswap.profile",
            "fake": True,
            "device": str(dev),
            "torch": torch.__version__,
            "repeat": 1,
            "hardware": hw.to_dict(),
            "times": cost.describe(),
            "attention": "fused" if fused else "as the device runs it",
            "parameters": model_parameters(model),
            "inputs": input_shapes(inputs),
        },
    )
    return with_parameter_gradients(graph, gradients)


def model_parameters(model) -> list[list]:
    """The model's parameters as [name, shape, dtype]: what a plan's runner compares with the
    model it runs (another width, a block added)."""
    return [
        [name, list(p.shape), str(p.dtype).replace("torch.", "")]
        for name, p in model.named_parameters()
    ]


def input_shapes(inputs) -> list[list]:
    """Every input tensor's [shape, dtype], in argument order (dict keys sorted). Plain loops:
    torch.compile traces it (``checkpointed``'s input check) without a graph break."""
    out: list[list] = []
    _collect_shapes(inputs, out)
    return out


def _collect_shapes(inputs, out: list[list]) -> None:
    import torch

    if isinstance(inputs, torch.Tensor):
        out.append([list(inputs.shape), str(inputs.dtype).replace("torch.", "")])
    elif isinstance(inputs, dict):
        for k in sorted(inputs):
            _collect_shapes(inputs[k], out)
    elif isinstance(inputs, (tuple, list)):
        for x in inputs:
            _collect_shapes(x, out)


class Untouched:
    """What profiling steps write that training owns, as it was before the first of them: each
    leaf's gradient (the steps start from none, so their timings do not include accumulation)
    and each state tensor's value (Tracer.state_before records them on first sight)."""

    def __init__(self) -> None:
        self.gradients: dict[int, tuple[Any, Any]] = {}
        self.state: dict[int, tuple[Any, Any]] = {}

    def take_gradients(self, loss) -> None:
        """Before a backward from ``loss``: every leaf it reaches (AccumulateGrad nodes) is
        recorded with its gradient on first sight, and its gradient set to none for the step."""
        seen, stack = set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            leaf = getattr(node, "variable", None)
            if leaf is not None:
                if id(leaf) not in self.gradients:
                    self.gradients[id(leaf)] = (leaf, leaf.grad)
                leaf.grad = None
                continue
            stack.extend(next_node for next_node, _ in node.next_functions)

    def restore(self) -> None:
        import torch

        for leaf, grad in self.gradients.values():
            leaf.grad = grad
        with torch.no_grad():
            for tensor, value in self.state.values():
                if tensor.shape == value.shape and not torch.equal(tensor, value):
                    tensor.copy_(value)
        self.gradients.clear()
        self.state.clear()
