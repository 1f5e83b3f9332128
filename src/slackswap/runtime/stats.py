"""What the executor did in the steps of a context entry (``Run.stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunStats:
    """What the executor did in the steps run under it (accumulated; peak is the maximum)."""

    steps: int = 0
    # the tensors it tracks (not gradients): SimResult.tensor_peak_bytes; a traced step tracks
    # every output, a skimmed one what it brings back, a hooked one nothing
    peak_activation_bytes: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    recomputed_bytes: int = 0
    recompute_s: float = 0.0
    wait_s: float = 0.0
    # host time inside the copy lanes' calls (offload, prefetch): on the CPU the copies
    # themselves, on CUDA their issue only (the copies run on their streams)
    copy_s: float = 0.0
    host_pool_bytes: int = 0
    # steps run untraced: a plan that keeps everything is checked (names, bytes, peak) on the
    # first step of a context and on any step whose inputs change shape; the others run as
    # plain training (peak_activation_bytes is the traced steps')
    untraced_steps: int = 0
    # later steps of a plan that moves tensors, named by the checked step's order of saves
    # (runtime/checked_step.py) without per-op naming: ``skimmed_steps`` all of them,
    # ``hooked_steps`` those run with no dispatch mode at all (a plan that rebuilds nothing)
    skimmed_steps: int = 0
    hooked_steps: int = 0
    # a backward has been called in the context (a step that failed after it cannot be run
    # again as if nothing happened: gradients may have been accumulated)
    backward_started: bool = False
