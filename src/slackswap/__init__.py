"""slackswap: plan the activation memory of a training step.

For every activation saved for backward: keep it on the device, swap it to host memory over the
copy lanes, or recompute it, under a device-memory budget. Layers, each importing only those
before it: core (data types and the step model), check (simulator, independent checker),
planners, solve; runtime (profiler, executor; torch) depends on core only and loads lazily.
"""

from .check.simulate import SimResult, simulate
from .check.simulate_stage import (
    PipelineSimResult,
    StageSimResult,
    simulate_pipeline,
    simulate_rank,
    simulate_stage,
)
from .check.validate import Validation, validate
from .check.validate_stage import StageValidation, validate_rank, validate_stage
from .check.violation import Violation
from .cnn import CNN_SHAPES, cnn_graph
from .compare import compare, result_row
from .core.budget import keep_all_peak, parse_budget
from .core.complete import complete, load_plan
from .core.errors import GraphError, InfeasibleBudget, PlanError
from .core.graph import ActivationGraph, Op, Tensor, load_graph
from .core.hardware import Hardware, hardware, hardware_names
from .core.pipeline import PipelineSchedule, StagePlan
from .core.plan import Decision, Plan, Schedule, SolveInfo
from .core.stages import split_stages
from .fit import FitReport, fit
from .fit_stages import StagesFitReport, fit_stages
from .pipeline import (
    keep_all_rank_peak,
    keep_all_stage_peak,
    plan_for_stages,
    plan_rank,
    plan_stage,
    smallest_rank_peak,
    smallest_stage_peak,
)
from .planners.base import is_available
from .solve import (
    min_budget,
    register_solver,
    smallest_budget,
    solve,
    solver_names,
)
from .workloads import (
    WORKLOADS,
    TransformerConfig,
    stage_graph,
    transformer_graph,
    workload,
    workload_stages,
)

__version__ = "0.2.0"

__all__ = [
    "ActivationGraph",
    "CNN_SHAPES",
    "Decision",
    "FitReport",
    "GraphError",
    "Hardware",
    "InfeasibleBudget",
    "Op",
    "PipelineSchedule",
    "PipelineSimResult",
    "Plan",
    "PlanError",
    "Schedule",
    "SimResult",
    "SolveInfo",
    "StagePlan",
    "StagesFitReport",
    "StageSimResult",
    "StageValidation",
    "Tensor",
    "TransformerConfig",
    "Validation",
    "Violation",
    "WORKLOADS",
    "cnn_graph",
    "compare",
    "complete",
    "fit",
    "fit_stages",
    "hardware",
    "hardware_names",
    "is_available",
    "keep_all_peak",
    "keep_all_rank_peak",
    "keep_all_stage_peak",
    "load_graph",
    "load_plan",
    "min_budget",
    "parse_budget",
    "plan_for_stages",
    "plan_rank",
    "plan_stage",
    "register_solver",
    "result_row",
    "simulate",
    "simulate_pipeline",
    "simulate_rank",
    "simulate_stage",
    "smallest_budget",
    "smallest_rank_peak",
    "smallest_stage_peak",
    "solve",
    "solver_names",
    "split_stages",
    "stage_graph",
    "transformer_graph",
    "validate",
    "validate_rank",
    "validate_stage",
    "workload",
    "workload_stages",
]

_LAZY = {
    "lp_bound": ("slackswap.planners.lpbound", "lp_bound"),
    "departure_bound": ("slackswap.planners.departures", "departure_bound"),
    "profile": ("slackswap.runtime.profiler", "profile"),
    "calibrate_link": ("slackswap.runtime.link", "calibrate_link"),
    "apply": ("slackswap.runtime.executor", "apply"),
    "plan_for_ranks": ("slackswap.distributed", "plan_for_ranks"),
    "planned": ("slackswap.loop", "planned"),
    "checkpoint_policy": ("slackswap.runtime.checkpoint", "checkpoint_policy"),
    "checkpointed": ("slackswap.runtime.checkpoint", "checkpointed"),
    "boundary_pins": ("slackswap.runtime.checkpoint_regions", "boundary_pins"),
    "checkpoint_graph": ("slackswap.runtime.checkpoint_regions", "checkpoint_graph"),
    "StepMeter": ("slackswap.runtime.meter", "StepMeter"),
    "hf_config": ("slackswap.runtime.hf_models", "hf_config"),
    "meta_model": ("slackswap.runtime.hf_models", "meta_model"),
    "training_batch": ("slackswap.runtime.hf_models", "training_batch"),
}


# integrations, imported when first named: ss.hf (the Hugging Face Trainer), ss.lightning
_SUBMODULES = {"hf": "transformers", "lightning": "lightning"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        try:
            return importlib.import_module(f"slackswap.{name}")
        except ModuleNotFoundError as exc:
            raise ImportError(
                f"slackswap.{name} needs {exc.name!r}, which is not installed: "
                "pip install 'slackswap[trainers]'"
            ) from exc
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            raise ImportError(
                f"slackswap.{name} needs {exc.name!r}, which is not installed: "
                "pip install 'slackswap[torch]'"
            ) from exc
    raise AttributeError(f"module 'slackswap' has no attribute {name!r}")
