"""Tracing a torch training step at aten-op granularity, with names that survive across steps.

Shared by the profiler (which builds an ActivationGraph from it) and the executor (which finds the
plan's tensors again in later steps). A tensor is named by the module that produced it and its
position among that module's outputs in the step ("encoder.layers.0.linear1#2"); views and
in-place results keep the name of their base storage. torch is imported here only.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .trace_records import GpuClock, ModulePaths, OpRecord, StepTrace, TensorRecord

RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal", "multinomial", "randperm", "uniform")


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(device index, -1 for CPU; storage address): what makes two tensors one storage. A
    wrapper subclass (FSDP2's sharded DTensor parameters) is keyed by its local tensor."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        if is_fake(t):  # no data: the storage object itself (views share it)
            return (t.get_device(), t.untyped_storage()._cdata)
        t = local_tensor(t)
    return (t.get_device(), t.untyped_storage().data_ptr())


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensorMode tensor (shape, dtype and device without data): a fake profile's."""
    return getattr(t, "fake_mode", None) is not None


def _storage_id(t: torch.Tensor) -> int:
    """The identity of the storage object behind ``t`` (stable while its data is freed and
    allocated again, as FSDP2 does with unsharded parameters)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        t = local_tensor(t)
    return t.untyped_storage()._cdata


def sharding_units(model: torch.nn.Module) -> list[str]:
    """Module paths (as ModulePaths names them) of the model's FSDP2 units, innermost first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return []
    names = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    inner = sorted((n for n in names if n), key=len, reverse=True)
    return inner + (["model"] if "" in names else [])


class UnitOf:
    """The sharding unit of a module path: the innermost FSDP2 unit containing it, or ""."""

    def __init__(self, units: list[str]):
        self.units = units
        self.known: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        unit = self.known.get(path)
        if unit is None:
            unit = ""
            if self.units and path != "step":
                unit = next(
                    (
                        u
                        for u in self.units
                        if u == "model" or path == u or path.startswith(u + ".")
                    ),
                    "",
                )
            self.known[path] = unit
        return unit


# record_function spans in which a sharding wrapper does its own work (FSDP2)
INTERNAL_SPANS = ("FSDP::",)
SPAN_OPS = frozenset(("_record_function_enter_new", "_record_function_exit"))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the data of ``t``: a DTensor's local shard, else ``t`` itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def collect_tensors(items, out: list) -> list:
    """The tensors in an op's arguments or results (aten nests at most lists and tuples)."""
    for a in items:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            collect_tensors(a, out)
    return out


_OP_INFO: dict[Any, tuple[str, str, bool, bool]] = {}


def op_info(func) -> tuple[str, str, bool, bool]:
    """(packet name, full name, draws random numbers, writes in place), cached per overload."""
    info = _OP_INFO.get(func)
    if info is None:
        aten = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        info = (aten, str(func), any(r in aten for r in RANDOM_OPS), aten.endswith("_"))
        _OP_INFO[func] = info
    return info


_MUTATES: dict[Any, bool] = {}
# ops whose schema does not mark the running statistics they update in training (positional
# arguments 3 and 4, the training flag at 5); their values can also come out unchanged (a
# cumulative average over identical batches), so the schema, the values and this list together
UNMARKED_WRITERS = {"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"}


def writes_unmarked(aten: str, args) -> bool:
    """Whether a call of one of UNMARKED_WRITERS updates running statistics."""
    return (
        aten in UNMARKED_WRITERS
        and len(args) > 5
        and bool(args[5])
        and (args[3] is not None or args[4] is not None)
    )


def mutates_state(func) -> bool:
    """Whether the op writes into one of its arguments (its schema marks it ``(a!)``): BatchNorm's
    running statistics, a counter's ``add_``. Running it again would update that state twice,
    so the profiler marks it not recomputable."""
    known = _MUTATES.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = bool(
            schema is not None
            and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        )
        _MUTATES[func] = known
    return known


def written_arguments(func, args, kwargs) -> list:
    """The arguments an op writes into (its schema marks them ``(a!)``), tensors or not."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if a.kwarg_only or i >= len(args):
                if a.name in kwargs:
                    out.append(kwargs[a.name])
            else:
                out.append(args[i])
    return out


class LiveStorages:
    """Storages alive while any tensor object registered on them is alive, counted per key with
    weak references: the profiler learns when the model lets go of a tensor (``on_release``),
    the executor how many bytes are resident (``total``, ``peak``)."""

    def __init__(self, on_release=None):
        self.on_release = on_release
        self.count: dict[Any, int] = {}
        self.total = 0
        self.peak = 0
        self._refs: dict[int, tuple[weakref.ref, Any, int]] = {}

    def __contains__(self, key) -> bool:
        return key in self.count

    def __len__(self) -> int:
        return len(self.count)

    def add(self, t: torch.Tensor, key, nbytes: int = 0) -> None:
        if key not in self.count:
            self.count[key] = 0
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
        self.count[key] += 1
        ref = weakref.ref(t, self._drop)
        self._refs[id(ref)] = (ref, key, nbytes)  # by id: weak references compare by their tensors

    def _drop(self, ref) -> None:
        _, key, nbytes = self._refs.pop(id(ref))
        left = self.count[key] - 1
        if left:
            self.count[key] = left
            return
        del self.count[key]
        self.total -= nbytes
        if self.on_release is not None:
            self.on_release(key)


class Tracer(TorchDispatchMode):
    """Records every aten op of a forward pass and which storages it reads and writes."""

    def __init__(
        self,
        model: torch.nn.Module,
        paths: ModulePaths,
        keep_calls: bool = False,
        sync=None,
        observe_lifetimes: bool = False,
        clock: GpuClock | None = None,
        watch_state: bool = False,
        originals: dict | None = None,
        cost=None,
        fake: bool = False,
        values=None,
    ):
        super().__init__()
        self.clock = clock
        # a fake step (profile(fake=True)): op times from ``cost(func, args, kwargs, out)``, and
        # storages known by their storage objects (they have no data address)
        self.cost = cost
        self.fake = fake
        # a fake step's InputValues (runtime/fake.py): reads the values a real step reads
        self.values = values
        self._fake_keys: dict[str, tuple[int, int]] = {}
        # the profiler: compare the state an op reads (buffers, tensors the step did not make)
        # before and after it, since a schema need not say that the op writes it
        self.watch_state = watch_state
        # the first value of each state tensor seen, by id (the profiler puts them back)
        self.originals = originals
        self.observe_lifetimes = observe_lifetimes
        self.held = LiveStorages(on_release=self._released)  # by tensor name
        self.paths = paths
        self.trace = StepTrace()
        self.keep_calls = keep_calls
        self.sync = sync
        self.external = {storage_key(p) for p in model.parameters()}
        self.external |= {storage_key(b) for b in model.buffers()}
        # parameters by storage identity (a storage's address changes when FSDP2 frees and
        # gathers it again; the storage object does not): never activations. The storages are
        # held for the step, so no activation's storage can take a freed one's identity.
        self.param_storages: dict[int, Any] = {}
        for p in model.parameters():
            self._hold_parameter(p)
        self.internal_depth = 0  # > 0 inside a sharding wrapper's own work (FSDP:: spans)
        self._spans: list[bool] = []  # open record_function spans: internal or not
        self.unit_of = UnitOf(sharding_units(model))
        self.by_storage: dict[tuple[int, int], str] = {}
        self.storage_ids: dict[tuple[int, int], int] = {}  # the storage object each name is for
        # a weak reference to each named storage: the storage's data goes when the model lets
        # go of it, its object stays allocated while the name does, so no later storage can
        # take both its address and its object's (malloc reuses both, and then an untraced
        # tensor, such as one made from numpy, would be taken for a freed named one)
        self.storage_refs: dict[tuple[int, int], StorageWeakRef] = {}
        self.counters: dict[str, int] = defaultdict(int)
        self.op_counters: dict[str, int] = defaultdict(int)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo guard unless the mode opts out;
        # the guard costs about 50 us per op (measured, torch 2.13 CPU), more than most ops. The
        # tracer runs eagerly and is never compiled, so it opts out.
        return False

    def tensor_name(self, t: torch.Tensor) -> str | None:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            t = local_tensor(t)
        elif self.fake:  # a real tensor in a fake step: a constant the model made, never named
            return None
        storage = t.untyped_storage()
        key = (t.get_device(), storage._cdata if self.fake else storage.data_ptr())
        if key in self.external:
            return None
        cdata = storage._cdata
        if cdata in self.param_storages:
            return None
        name = self.by_storage.get(key)
        # a storage allocated where a named one was freed, by something the tracer did not see
        # (another thread: a collective's buffers), is another storage: not that name
        if name is not None and self.storage_ids.get(key) != cdata:
            return None
        return name

    def state_before(
        self, in_tensors: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """Copies of the state an op reads: tensors the step did not make (buffers, inputs,
        tensors the loss function holds) that autograd does not track. Parameters are left out:
        autograd refuses an in-place write on a leaf that requires grad."""
        state = []
        for t in in_tensors:
            if t.requires_grad or type(t) is not torch.Tensor or t.is_meta:
                continue
            if self.tensor_name(t) is None:
                before = t.detach().clone()
                state.append((t, t._version, before))
                if self.originals is not None and id(t) not in self.originals:
                    self.originals[id(t)] = (t, before)
        return state

    @staticmethod
    def state_written(state) -> bool:
        """Whether the op changed any of that state (its version counter or its values: batch
        norm's ``native_batch_norm`` updates the running statistics without either its schema
        or the version counter saying so)."""
        for t, version, before in state:
            if t._version != version or t.shape != before.shape or not torch.equal(t, before):
                return True
        return False

    def wrapper_internal(self, func, args, opened: bool = False) -> bool:
        """Whether this op is a wrapper's own work (FSDP2's all-gathers, copy-outs and frees run
        inside ``FSDP::`` record_function spans; DDP's prelude, ``ModulePaths.in_ddp_prelude``):
        not the model's computation, so not traced. record_function spans nest, so a stack
        matches each exit to its enter; called again with ``opened`` once an enter op has run.
        Parameters the model reads are recognised by type as well (``note_parameters``)."""
        aten = op_info(func)[0]
        if aten == "_record_function_enter_new":
            if opened:
                internal = (
                    bool(args) and isinstance(args[0], str) and args[0].startswith(INTERNAL_SPANS)
                )
                self._spans.append(internal)
                self.internal_depth += internal
            return self.internal_depth > 0 or (
                bool(args) and isinstance(args[0], str) and args[0].startswith(INTERNAL_SPANS)
            )
        if aten == "_record_function_exit":
            internal = self.internal_depth > 0
            if self._spans:
                self.internal_depth -= self._spans.pop()
            return internal
        return self.internal_depth > 0 or self.paths.in_ddp_prelude

    def reads_parameters(self, in_tensors) -> bool:
        if not self.unit_of.units:
            return False
        params = self.param_storages
        return any(_storage_id(t) in params for t in in_tensors)

    def wrapper_work(self, func, args, kwargs) -> tuple[bool, Any]:
        """(True, its result) when the op is a sharding wrapper's own work, run here untraced;
        (False, None) otherwise. Either way the record_function spans are kept track of."""
        aten = op_info(func)[0]
        if aten not in SPAN_OPS and not self.internal_depth and not self.paths.in_ddp_prelude:
            return False, None  # (wrapper_internal's answer for the model's own ops, inlined)
        enter = aten == "_record_function_enter_new"
        if not self.wrapper_internal(func, args):
            if enter:
                self.wrapper_internal(func, args, opened=True)
            return False, None
        out = func(*args, **kwargs)
        if enter:
            self.wrapper_internal(func, args, opened=True)
        self.forget_outputs(out, args, kwargs)
        return True, out

    def forget_outputs(self, out, args, kwargs) -> None:
        """An untraced op (a wrapper's own work) made ``out``: a storage it allocated may sit
        where a freed activation was, and that activation's name is not its name. Outputs that
        alias an argument (views, the identity functions FSDP wraps module inputs in) keep it."""
        tensors = (
            [out]
            if isinstance(out, torch.Tensor)
            else collect_tensors(out if isinstance(out, (list, tuple)) else [], [])
        )
        if not tensors:
            return
        try:
            _, in_keys = self.input_keys(args, kwargs)
            keys = [storage_key(t) for t in tensors]
        except RuntimeError:  # a wrapper subclass without storage
            return
        for key in keys:
            if key not in in_keys:
                self.by_storage.pop(key, None)

    def _hold_parameter(self, p: torch.Tensor) -> None:
        storage = local_tensor(p).untyped_storage()
        self.param_storages[storage._cdata] = storage

    def note_parameters(self, in_tensors) -> None:
        for t in in_tensors:
            # isinstance(t, Parameter), whose metaclass's Python __instancecheck__ costs more
            # than the rest of this: a plain tensor is one when flagged _is_param
            if (
                getattr(t, "_is_param", False)
                if type(t) is torch.Tensor
                else isinstance(t, torch.nn.Parameter)
            ):
                self._hold_parameter(t)

    def _released(self, name: str) -> None:
        if self.observe_lifetimes:
            self.trace.released_after[name] = len(self.trace.ops) - 1
        if self.fake:
            # a fake storage is known by its object's address, which the next one may take: the
            # name goes with the last tensor on it (a real storage is checked by address and
            # object, storage_ids)
            key = self._fake_keys.pop(name, None)
            if key is not None and self.by_storage.get(key) == name:
                del self.by_storage[key]

    def __exit__(self, *exc):
        self.observe_lifetimes = False  # what is alive now lives to the end of the forward
        # the tracker's callback was the tracer's only cycle: without it the tracer, and the
        # parameter storages it holds, go with their last reference, not at the next collection
        self.held.on_release = None
        return super().__exit__(*exc)

    def input_keys(self, args, kwargs) -> tuple[list[torch.Tensor], set]:
        """An op's tensor arguments and their storages."""
        in_tensors = collect_tensors(args, [])
        if kwargs:
            collect_tensors(kwargs.values(), in_tensors)
        return in_tensors, {storage_key(t) for t in in_tensors}

    def name_outputs(self, out, in_keys: set, inplace: bool, module: str, producer: int | None):
        """Name the storages an op made (``module#counter``, in the order of its outputs) and
        note the traced storages it wrote in place. The profiler and the executor share this,
        so a tensor has the same name in both. Returns (output tensors, their (storage key,
        storage) pairs, new names, writes)."""
        if isinstance(out, torch.Tensor):
            out_tensors = [out]
        elif isinstance(out, (list, tuple)):
            out_tensors = collect_tensors(out, [])
        else:
            out_tensors = []
        outputs = []
        writes = []
        stored = []
        by_storage = self.by_storage
        for t in out_tensors:
            storage = t.untyped_storage()
            # storage_key, without a second lookup
            key = (t.get_device(), storage._cdata if self.fake else storage.data_ptr())
            stored.append((key, storage))
            if key in in_keys:
                # a view or an in-place result: same storage, same tensor
                if inplace and by_storage.get(key) is not None:
                    writes.append(by_storage[key])
                continue
            name = f"{module}#{self.counters[module]}"
            self.counters[module] += 1
            by_storage[key] = name
            self.storage_ids[key] = storage._cdata
            if not self.fake:
                self.storage_refs[key] = StorageWeakRef(storage)
            if self.fake:
                self._fake_keys[name] = key
            if producer is not None:
                self.trace.tensors[name] = TensorRecord(
                    name=name,
                    bytes=int(storage.nbytes()),
                    shape=tuple(t.shape),
                    dtype=str(t.dtype).replace("torch.", ""),
                    producer=producer,
                )
            outputs.append(name)
        return out_tensors, stored, outputs, writes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._current_autograd_node() is not None:
            return func(*args, **kwargs)  # backward ops are not part of the forward trace
        if (
            self.fake and getattr(func, "namespace", "") == "prim"
        ):  # a fake tensor's metadata queries
            return func(*args, **kwargs)
        skipped, out = self.wrapper_work(func, args, kwargs)
        if skipped:
            return out
        aten, full, random, inplace = op_info(func)
        inplace = inplace or "out" in kwargs
        in_tensors, in_keys = self.input_keys(args, kwargs)
        self.note_parameters(in_tensors)
        inputs = []
        for t in in_tensors:
            name = self.tensor_name(t)
            if name is not None and name not in inputs:
                inputs.append(name)
        seq = torch._C._autograd._get_sequence_nr() - 1
        state = self.state_before(in_tensors) if self.watch_state else ()
        clock = self.clock
        if self.cost is not None:
            out = (
                func(*args, **kwargs)
                if self.values is None
                else self.values.call(func, args, kwargs)
            )
            elapsed = self.cost(func, args, kwargs, out)
        elif clock is not None:
            began = clock.mark()
            out = func(*args, **kwargs)
            ended = clock.mark()
            elapsed = 0.0  # resolved from the events after the step
        else:
            if self.sync:
                self.sync()
            start = time.perf_counter()
            out = func(*args, **kwargs)
            if self.sync:
                self.sync()
            elapsed = time.perf_counter() - start
        wrote_state = (bool(state) and self.state_written(state)) or writes_unmarked(aten, args)
        # an in-place write into tensors of the step alone (a dropout mask's bernoulli_, an
        # in-place ReLU) may run again as part of a rebuild: producer, then writers in order
        graph_write = False
        if (inplace or "out" in kwargs) and not wrote_state:
            targets = collect_tensors(written_arguments(func, args, kwargs), [])
            graph_write = bool(targets) and all(
                self.tensor_name(t) is not None and storage_key(t) not in self.external
                for t in targets
            )
        module = self.paths.current
        if self.fake and aten == "lift_fresh":
            # a constant made in the step (torch.tensor(...)) entering the fake mode: the real
            # op returns its argument, which the trace does not name; nor is its fake named
            in_keys = in_keys | {storage_key(t) for t in collect_tensors([out], [])}
        out_tensors, stored, outputs, writes = self.name_outputs(
            out, in_keys, inplace, module, len(self.trace.ops)
        )
        if self.observe_lifetimes:
            for t, (key, _) in zip(out_tensors, stored):
                name = self.by_storage.get(key)
                if name is not None and key not in self.external:
                    self.held.add(t, name)
        op_name = f"{module}/{aten}#{self.op_counters[module]}"
        self.op_counters[module] += 1
        self.trace.ops.append(
            OpRecord(
                name=op_name,
                aten=full,
                module=module,
                inputs=inputs,
                outputs=outputs,
                seq=seq,
                forward_s=elapsed,
                random=random,
                inplace=inplace,
                writes=writes,
                mutates=(inplace or wrote_state or mutates_state(func)) and not graph_write,
                unit=self.unit_of(module),
                param_unit=self.unit_of(module) if self.reads_parameters(in_tensors) else "",
                func=func if self.keep_calls else None,
                args=args if self.keep_calls else None,
                kwargs=kwargs if self.keep_calls else None,
            )
        )
        if clock is not None and self.cost is None:
            clock.spans.append((began, ended, self.trace.ops[-1], None))
        return out
