"""Planner backends that are not integer programs."""
