"""The planners behind one interface and a registry keyed by name (base.py): the baselines,
the SlackSwap heuristic, the exact planner (exact/) and the bounds that prove their plans."""
