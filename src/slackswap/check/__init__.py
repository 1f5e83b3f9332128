"""The independent checker (validate: a plan's complete schedule walked from the graph and the
decisions alone, no planner or step-model code) and the simulator (the step's timeline)."""
