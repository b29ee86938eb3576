"""The wstream client: create or attach jobs and train them as streaming workers.

```python
from wstream.client import Client, AdamW
client = Client("tcp://127.0.0.1:5555")
job = client.create_job("demo", stages=modules, optimizer=AdamW(lr=1e-3), token="secret")
trainer = job.trainer(device="cpu")
loss = trainer.step(inputs, targets, loss_fn)
weights = job.state_dict()
```
"""

from wstream.protocol import (
    SGD,
    AdamW,
    AuthError,
    Constant,
    GradientError,
    InverseSqrt,
    JobExistsError,
    JobOptions,
    LayoutError,
    MemoryLimitError,
    MultiStep,
    Piecewise,
    ProtocolError,
    Schedule,
    ServerUnavailable,
    WaitTimeoutError,
    SessionExpiredError,
    StaleStepError,
    StateError,
    UnknownJobError,
    Warmup,
    WarmupCosine,
    WarmupLinear,
    WstreamError,
    lr_at,
)

from .client import Client
from .job_handle import Job
from .groups import ParamGroup, no_decay
from .local import local_server
from .options import Checkpointing, Parallelism, Precision, Transport
from .plans.plan import PlanError
from .loss_scale import LossScale
from .stages import Tied
from .trainer import Resynced, Trainer, TrainerStats
from .wait import wait_for_server

__all__ = [
    "SGD",
    "AdamW",
    "AuthError",
    "Checkpointing",
    "Client",
    "Constant",
    "GradientError",
    "InverseSqrt",
    "Job",
    "JobExistsError",
    "JobOptions",
    "LayoutError",
    "LossScale",
    "MemoryLimitError",
    "MultiStep",
    "ParamGroup",
    "Parallelism",
    "PlanError",
    "Piecewise",
    "Precision",
    "ProtocolError",
    "Resynced",
    "Schedule",
    "ServerUnavailable",
    "WaitTimeoutError",
    "SessionExpiredError",
    "StaleStepError",
    "StateError",
    "Tied",
    "Trainer",
    "TrainerStats",
    "Transport",
    "UnknownJobError",
    "Warmup",
    "WarmupCosine",
    "WarmupLinear",
    "WstreamError",
    "local_server",
    "lr_at",
    "no_decay",
    "wait_for_server",
]
