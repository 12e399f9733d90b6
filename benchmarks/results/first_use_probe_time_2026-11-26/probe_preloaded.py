import sys, time
if sys.argv[1] == "preloaded":  # what flexplan.load / run have imported before their first plan
    import torch  # noqa
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa
from flexplan.calibration.cli import calibrate
t = time.perf_counter()
calibrate(mode="probe", out=f"/tmp/ab/pp_{sys.argv[1]}.yaml", progress=False)
print(sys.argv[1], "%.1f s" % (time.perf_counter() - t))
