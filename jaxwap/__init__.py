"""jaxwap: a workload-aware auto-parallelizer for JAX training steps.

`jaxwap.auto_shard(train_step, params)` reads the step's own cost, picks how many devices
to use and a PartitionSpec for every parameter (balancing speed against energy), and
compiles the step with `jax.jit` shardings.
"""

from .api import AutoShardedStep, auto_shard, plan
from .cache import PlanCache
from .calibrate import Calibration, calibrate, load_calibration
from .constraints import logical_constraints
from .energy import EnergyMeter, EnergyReading, measure_energy
from .hardware import Cluster, DeviceSpec, HostMemory, builtin_device_names, device_spec
from .objective import Objective
from .options import PlanOptions
from .plan import Candidate, ParamPlacement, Plan
from .records import STRATEGY_FAMILIES, Measurement, Prediction, StepVariant, Strategy
from .train_step import TrainStep, make_train_step
from .version import __version__

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
    "device_spec",
    "make_train_step",
    "plan",
    "__version__",
]
