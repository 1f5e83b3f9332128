"""The exact planner: one MILP formulation (formulations/milp.md), several solver backends."""
