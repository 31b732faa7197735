"""From a step's jaxpr to the facts the cost model prices, with no hardware figure in sight:
which leaf is what (`roles`), the trace, the flat program, each primitive's rules, dataflow,
liveness, each op's work, what data parallelism reduces and FSDP gathers, which activations
tensor parallelism splits, the graph that gathers it all, and the adapter to cuDNN's fused
attention. Imports `core` and `hardware`.
"""
