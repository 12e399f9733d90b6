"""flexplan: plan and run LLM inference over a modest GPU and a big CPU (FlexInfer and beyond).

    import flexplan
    p = flexplan.plan("facebook/opt-66b", hardware="flexinfer-server2", batch_size=16, input_len=512, output_len=32)
    p.prefill.policy, p.decode.policy, p.e2e_s

    lm = flexplan.load(path_or_model)          # generate()-compatible, plan="auto"
    out = lm.generate(**inputs, max_new_tokens=32)

    engine = flexplan.Engine.from_pretrained(path)   # serving: continuous batching over many requests
    engine.add_request("a", "Hello", flexplan.SamplingParams(max_tokens=16, temperature=0))
    while engine.has_unfinished(): outputs = engine.step()

Importing flexplan does not import torch; ``flexplan.load`` does.
"""

from flexplan.errors import (
    CalibrationError,
    DeviceUnavailableError,
    DoesNotFitError,
    FlexplanError,
    InvalidInputError,
    MalformedDataError,
    UnknownHardwareError,
    UnknownModelError,
    UnsupportedModelError,
)
from flexplan.estimator.policies import POLICIES
from flexplan.plan_types import Candidate, PhaseChoice, Plan
from flexplan.planner import plan
from flexplan.version import __version__

__all__ = [
    "POLICIES", "CalibrationError", "Candidate", "DeviceUnavailableError", "DoesNotFitError", "FlexplanError",
    "InvalidInputError", "MalformedDataError", "PhaseChoice", "Plan", "UnknownHardwareError", "UnknownModelError",
    "UnsupportedModelError", "Engine", "SamplingParams", "load", "plan",
]


def __getattr__(name):
    # load imports torch and the executor: imported on first use so that `import flexplan` and
    # plan() stay torch-free (a second of import time for users who only plan)
    if name == "load":
        from flexplan.api import load

        return load
    if name == "Engine":  # the serving engine (continuous batching): torch and transformers too
        from flexplan.serving.engine import Engine

        return Engine
    if name == "SamplingParams":
        from flexplan.serving.types import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'flexplan' has no attribute {name!r}")
