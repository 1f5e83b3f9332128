"""slackswap: plan the activation memory of a training step.

For every activation saved for backward: keep it on the device, swap it to host memory over the
copy lanes, or recompute it, under a device-memory budget. torch is imported only by the
profiler and the executor.
"""

from .budget import keep_all_peak, min_budget, parse_budget
from .errors import GraphError, InfeasibleBudget, PlanError
from .graph import ActivationGraph, Op, Tensor, load_graph
from .hardware import Hardware, hardware, hardware_names
from .plan import Plan, Schedule, SolveInfo, load_plan
from .simulate import SimResult, simulate
from .solve import compare, register_solver, solve, solver_names
from .validate import Validation, Violation, validate
from .workloads import WORKLOADS, TransformerConfig, transformer_graph, workload

__version__ = "0.1.0"

__all__ = [
    "ActivationGraph", "GraphError", "Hardware", "InfeasibleBudget", "Op", "Plan", "PlanError",
    "Schedule", "SimResult", "SolveInfo", "Tensor", "TransformerConfig", "Validation", "Violation",
    "WORKLOADS", "compare", "hardware", "hardware_names", "keep_all_peak", "load_graph",
    "load_plan", "min_budget", "parse_budget", "register_solver", "simulate", "solve",
    "solver_names", "transformer_graph", "validate", "workload",
]


def __getattr__(name: str):
    lazy = {
        "lp_bound": ("slackswap.lpbound", "lp_bound"),
        "profile": ("slackswap.profiler", "profile"),
        "calibrate_link": ("slackswap.profiler", "calibrate_link"),
        "apply": ("slackswap.executor", "apply"),
    }
    if name in lazy:
        import importlib

        module, attr = lazy[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            raise ImportError(f"slackswap.{name} needs {exc.name!r}, which is not installed: "
                              "pip install 'slackswap[torch]'") from exc
    raise AttributeError(f"module 'slackswap' has no attribute {name!r}")
