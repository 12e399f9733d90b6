"""What the machine is: hwdb/ spec database and introspection of the local machine."""

from flexplan.hardware.hwdb import check_overrides, is_local_name, resolve
from flexplan.hardware.introspect import local_hardware
from flexplan.hardware.spec import CPUSpec, GPUSpec, Hardware, LinkSpec, canonical_dtype

__all__ = ["CPUSpec", "GPUSpec", "Hardware", "LinkSpec", "canonical_dtype", "get_hardware"]


def get_hardware(name: str = "local", **overrides) -> Hardware:
    """A named hwdb server (``flexinfer-server2``), a composition ``CPU[xS]+GPU+LINK``, or
    ``"local"`` (introspected). ``overrides`` replace fields (``gpu_memory_bytes=...``)."""

    if is_local_name(name):
        return local_hardware(**check_overrides(overrides))
    return resolve(name, **overrides)
