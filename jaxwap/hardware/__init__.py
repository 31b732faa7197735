"""What the cost model knows about devices: one device's profile (`device`), the power a
step draws (`power_model`), a cluster of devices and how they are linked, and its detection
from the devices present (`cluster`), and the record of a measured profile (`calibration`).
Imports only `core`; measuring a profile is `jaxwap.calibration`'s, which sits higher.
"""
