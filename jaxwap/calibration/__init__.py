"""Measuring a device profile on the devices present: the timed probes (by device kind), the
host's call costs, the fits, the disk store and the cross-process agreement behind
`jaxwap.calibrate`. Sits above `runtime` (it compiles probes) and `cost` (it fits the
collective model); the record it produces lives in `hardware.calibration`.
"""
