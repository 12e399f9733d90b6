"""The package's shape: no import cycles, the factors layer below the executor and the measuring
harness, and plan() free of side effects (no benchmark, probe, subprocess or file write)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flexplan"
DATA_PACKAGES = ("flexplan._calibration", "flexplan._hwdb")  # folders of data files mapped into the package
# the only imports of flexplan modules inside functions, each for a stated reason
LAZY_ALLOWED = {("flexplan", "flexplan.api"),  # `import flexplan` and plan() stay torch-free
                ("flexplan", "flexplan.serving.engine"), ("flexplan", "flexplan.serving.types"),  # the same
                ("flexplan.measure.membw", "flexplan.executor.cpu_linear")}  # the GEMV probe: torch only where loaded


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _target(module: str, node) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
            pkg = ".".join(pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)])
            base = f"{pkg}.{base}" if base else pkg
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    else:
        names = [a.name for a in node.names]
    out = []
    for n in names:
        if not (n == "flexplan" or n.startswith("flexplan.")) or n.startswith(DATA_PACKAGES):
            continue
        while n not in MODULES and "." in n:
            n = n.rsplit(".", 1)[0]
        out.append(n)
    return out


def _graph():
    edges, lazy = {m: set() for m in MODULES}, set()
    for m, path in MODULES.items():
        tree = ast.parse(path.read_text())
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(fn))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _target(m, node):
                    edges[m].add(t)
                    if id(node) in in_function:
                        lazy.add((m, t))
    return edges, lazy


EDGES, LAZY = _graph()


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for t in EDGES[todo.pop()]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_no_import_cycle_among_flexplan_modules():
    cycles = sorted(m for m in MODULES if m in _reach(m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_imports_sit_at_module_top_except_the_stated_lazy_ones():
    assert LAZY <= LAZY_ALLOWED, sorted(LAZY - LAZY_ALLOWED)


@pytest.mark.parametrize("layer", ["flexplan.factors", "flexplan.planner", "flexplan.estimator", "flexplan.placement"])
def test_planning_layers_import_no_executor_api_or_measuring(layer):
    above = [m for m in _reach(layer) if m.startswith(("flexplan.executor", "flexplan.api", "flexplan.measure"))]
    assert not above, f"{layer} reaches {sorted(above)}"


def test_plan_on_the_local_machine_runs_no_probe_subprocess_or_write_and_imports_no_torch(tmp_path):
    code = f"""
import builtins, os, subprocess, sys
writes = []
real_open = builtins.open
def guarded_open(file, mode="r", *a, **k):
    if any(c in str(mode) for c in "wax+"):
        writes.append(str(file))
    return real_open(file, mode, *a, **k)
builtins.open = guarded_open
def no_subprocess(*a, **k):
    raise AssertionError(f"subprocess during plan(): {{a}}")
subprocess.Popen.__init__ = no_subprocess
os.replace = os.rename = lambda *a, **k: writes.append(a)
import flexplan
p = flexplan.plan("HuggingFaceTB/SmolLM2-135M-Instruct", hardware="local", batch_size=2, input_len=64, output_len=8)
assert not writes, writes
assert "torch" not in sys.modules
assert not any(m.startswith("flexplan.measure") for m in sys.modules), sorted(sys.modules)
assert p.factors.state_probed is False
print("ok", p.factors.kind)
"""
    env = dict(os.environ, FLEXPLAN_CALIBRATION_DIR=str(tmp_path), XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")


def test_a_plan_carries_its_placement_and_its_factors_source_as_fields():
    import flexplan
    from flexplan.estimator.policies import placement_of

    p = flexplan.plan("HuggingFaceTB/SmolLM2-135M-Instruct", hardware="flexinfer-server2", batch_size=1,
                      input_len=128, output_len=16)
    assert p.placement is not None and p.placement.policies == {"prefill": p.prefill.policy, "decode": p.decode.policy}
    assert p.factors.kind == "defaults" and p.factors.age_s() is None
    again = flexplan.Plan.from_dict(p.to_dict())  # JSON has no placement: rebuilt from the policies, equal
    assert again.placement is None and placement_of(again, p.num_layers) == p.placement
    assert again.factors == p.factors


def test_the_cli_and_an_explain_on_hwdb_hardware_import_no_torch():
    code = ("import sys; from flexplan.cli import main; "
            "assert main(['explain', 'meta-llama/Llama-3.1-8B', '--hw', 'flexinfer-server2']) == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
