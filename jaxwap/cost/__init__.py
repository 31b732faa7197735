"""The cost model: what a collective costs, each op's time on a device, the time, memory and
energy of a candidate on one mesh, and of a pipelined one, assembled into a `Prediction` in
one place (`prediction`). Imports the layers below; never compiles.
"""
