"""Host memory a step frees is kept for the next (executor/host_allocator.py): malloc's setting is
process-wide, so each case runs in a child process."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys

import pytest

# a prefill-like pattern: per "layer", an MLP's activations (1024 tokens x 1536 float32: 6 MiB
# each) made and freed in turn, 10 layers per round; the minor page faults of rounds 2-5
CHILD = r"""
import json, resource, sys, torch
from flexplan.executor.host_allocator import keep_freed_memory
state = keep_freed_memory() if sys.argv[1] == "tune" else None
x = torch.ones(1024, 576)
w_up, w_down = torch.ones(576, 1536), torch.ones(1536, 576)
faults = []
for _ in range(5):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h = x
    for _ in range(10):
        gate, up = h @ w_up, h @ w_up
        act = torch.nn.functional.silu(gate)
        del gate
        mid = act * up
        del act, up
        h = mid @ w_down
        del mid
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print(json.dumps({"state": state, "faults_after_first": sum(faults[1:])}))
"""


# what keep_freed_memory() says it did, and nothing else (the state tests: no workload); the module
# (ctypes and os only) loaded from its file, without the executor package, which imports torch (~2 s)
STATE_CHILD = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("host_allocator", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps({"state": module.keep_freed_memory()}))
"""
MODULE = os.path.join(importlib.util.find_spec("flexplan").submodule_search_locations[0], "executor",
                      "host_allocator.py")


def _child(mode: str, code: str = CHILD, **env) -> dict:
    r = subprocess.run([sys.executable, "-c", code, mode, MODULE], capture_output=True, text=True, check=True,
                       env={**os.environ, **env})
    return json.loads(r.stdout.strip().splitlines()[-1])


glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")


@glibc_only
def test_glibc_malloc_is_tuned_to_keep_freed_memory():
    assert _child("tune", STATE_CHILD, LD_PRELOAD="")["state"].startswith("glibc malloc keeping freed memory")


@pytest.mark.slow  # two processes of 50 MLP passes each
@glibc_only
def test_freed_activations_are_not_faulted_in_again():
    """With glibc left as it is, memory freed within a round often goes back to the kernel and is
    faulted in again (how much depends on the thresholds glibc has adapted to so far: 27,000 to
    241,000 faults over rounds 2-5 in runs on the development VM); once tuned, the rounds after the
    first reuse it: not one activation's pages faulted in again."""
    env = {"LD_PRELOAD": ""}
    plain = _child("plain", **env)
    tuned = _child("tune", **env)
    assert tuned["state"].startswith("glibc malloc keeping freed memory")
    pages = (6 << 20) // 4096  # one activation
    assert tuned["faults_after_first"] < pages
    assert tuned["faults_after_first"] <= plain["faults_after_first"]


def test_opt_out_leaves_malloc_alone():
    got = _child("tune", STATE_CHILD, FLEXPLAN_HOST_ALLOCATOR="default")
    assert got["state"] == "malloc as the C library sets it ($FLEXPLAN_HOST_ALLOCATOR=default)"


@glibc_only
def test_another_malloc_is_left_alone(tmp_path):
    """A malloc other than glibc's (here a preloaded shim of no known allocator's name) is not
    tuned: the process's malloc symbol is compared with glibc's, not LD_PRELOAD's text."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a malloc shim")
    src = tmp_path / "shim.c"
    src.write_text("#include <stddef.h>\nextern void* __libc_malloc(size_t);\n"
                   "void* malloc(size_t n) { return __libc_malloc(n); }\n")
    lib = tmp_path / "libshim.so"
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, capture_output=True)
    got = _child("tune", STATE_CHILD, LD_PRELOAD=str(lib))
    assert got["state"] == f"another malloc than glibc's, left as it is (LD_PRELOAD={lib})"
