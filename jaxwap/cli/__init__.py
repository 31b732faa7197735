"""The command line, `jaxwap` (or `python -m jaxwap`): `calibrate`, `plan`, `explain`. The top
layer: it calls the public API and imports nothing that imports it.
"""
