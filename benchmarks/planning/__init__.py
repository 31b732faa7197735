"""What the planner chooses and what choosing costs: its choice against an oracle that
compiles every candidate (`plan_quality`), planning time (`plan_time`) and planning at cluster
scale (`scale`), the largest batch it fits beside plain `jax.jit` (`max_batch`), the idioms
users write (`idioms`), and a snapshot of its decisions to show a refactor leaves them
unchanged (`plan_snapshot`).
"""
