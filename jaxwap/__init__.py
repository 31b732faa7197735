"""jaxwap: a workload-aware auto-parallelizer for JAX training steps.

`jaxwap.auto_shard(train_step, params)` reads the step's own cost, picks how many devices
to use and a PartitionSpec for every parameter (balancing speed against energy), and
compiles the step with `jax.jit` shardings.
"""

from jaxwap.api import AutoShardedStep, auto_shard, clear_caches, plan
from jaxwap.calibration.calibrate import calibrate
from jaxwap.calibration.store import load_calibration
from jaxwap.core.objective import Objective
from jaxwap.core.records import STRATEGY_FAMILIES, Measurement, Prediction, StepVariant, Strategy
from jaxwap.core.version import __version__
from jaxwap.energy.meter import EnergyMeter, EnergyReading, measure_energy
from jaxwap.hardware.builtin_profiles import builtin_device_names, device_spec
from jaxwap.hardware.calibration import Calibration
from jaxwap.hardware.cluster import Cluster, HostMemory
from jaxwap.hardware.device import DeviceSpec
from jaxwap.options import PlanOptions
from jaxwap.plans.cache import PlanCache
from jaxwap.plans.plan import Candidate, ParamPlacement, Plan
from jaxwap.runtime.train_step import TrainStep, make_train_step
from jaxwap.search.constraints import logical_constraints

__all__ = [
    "AutoShardedStep",
    "Calibration",
    "EnergyMeter",
    "EnergyReading",
    "Measurement",
    "calibrate",
    "load_calibration",
    "logical_constraints",
    "measure_energy",
    "Candidate",
    "Cluster",
    "HostMemory",
    "DeviceSpec",
    "Objective",
    "ParamPlacement",
    "Plan",
    "PlanCache",
    "PlanOptions",
    "Prediction",
    "STRATEGY_FAMILIES",
    "StepVariant",
    "Strategy",
    "TrainStep",
    "auto_shard",
    "builtin_device_names",
    "clear_caches",
    "device_spec",
    "make_train_step",
    "plan",
    "__version__",
]
