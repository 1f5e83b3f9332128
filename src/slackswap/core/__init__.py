"""The data every stage shares: the graph, the plan, the hardware, budgets and units, and the
step model the planners and the simulator expand plans with (never the checker's walk)."""
