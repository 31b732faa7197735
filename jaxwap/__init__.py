"""jaxwap: a workload-aware auto-parallelizer for JAX training steps.

`jaxwap.auto_shard(train_step, params)` reads the step's own cost, picks how many devices
to use and a PartitionSpec for every parameter (balancing speed against energy), and
compiles the step with `jax.jit` shardings.
"""

__version__ = "0.1.0"

from .api import AutoShardedStep, auto_shard, plan  # noqa: E402
from .cache import PlanCache  # noqa: E402
from .calibrate import Calibration, calibrate, load_calibration  # noqa: E402
from .cost import Prediction, Strategy  # noqa: E402
from .energy import EnergyMeter, EnergyReading, measure_energy  # noqa: E402
from .hardware import Cluster, DeviceSpec, builtin_device_names, device_spec  # noqa: E402
from .measure import Measurement  # noqa: E402
from .objective import Objective  # noqa: E402
from .plan import Candidate, ParamPlacement, Plan  # noqa: E402
from .train_step import StepVariant, TrainStep, make_train_step  # noqa: E402

__all__ = [
    "AutoShardedStep",
    "Calibration",
    "EnergyMeter",
    "EnergyReading",
    "Measurement",
    "calibrate",
    "load_calibration",
    "measure_energy",
    "Candidate",
    "Cluster",
    "DeviceSpec",
    "Objective",
    "ParamPlacement",
    "Plan",
    "PlanCache",
    "Prediction",
    "StepVariant",
    "Strategy",
    "TrainStep",
    "auto_shard",
    "builtin_device_names",
    "device_spec",
    "make_train_step",
    "plan",
]
