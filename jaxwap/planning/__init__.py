"""The planner's steps, below `planner.make_plan` that runs them: the cluster planned for,
the devices usable and the memory budget (`devices`); one step variant's search bound to
the options and verified by XLA, re-searched under a tightened budget when XLA needs more
than predicted (`verified_search`); the step variants tried in order of cost until one fits,
pipelines and restructurings as optional branches (`step_variants`); and whether a plan
made elsewhere or read from the cache can run here (`plan_check`). Imports every layer
below and `options`; never `planner` or `api`.
"""
