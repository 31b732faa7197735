"""Pipelining: where the planner chooses it for large models on H100 clusters (`pipeline`),
a pipelined step's memory against XLA's (`pipeline_memory`), a pipeline measured on the
two-process cluster against the best non-pipelined step (`pipeline_measured`), and that
pipelined program profiled op by op (`pipeline_profile`).
"""
