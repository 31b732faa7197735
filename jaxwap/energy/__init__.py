"""Energy measured on real devices: the meter that reads NVML's counters (or says plainly it
modelled the figure), and the GPU power limit applied and undone. Imports `core` and
`hardware` only, so every layer that times a step can also meter it.
"""
