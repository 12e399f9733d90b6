"""Re-price a GPU host's `flexplan validate` CSV (its cold predictions of the set `probe`) with the
code of today, on the development VM: the host's hardware as its `flexplan hw` printed it (16-core
Xeon not in hwdb: bf16 34406 / fp32 2150 GFLOP/s peaks from its ISA, 40 GB/s assumed; the GPU
from hwdb, PCIe 5 x16, the 1.5 GiB budget of gpu_session.sh), the probes at the readings taken right
before each point's runs (benchmarks/rederive_cycles.py's `readings`).

    python benchmarks/results/gpu-h200-2026-11-26c/reprice_gpu_validation.py CSV CALIBRATION [GPU_HWDB_ID]
"""
import csv
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import rederive_cycles as rc  # noqa: E402

import flexplan  # noqa: E402
from flexplan.calibration import _at_state_now, _calibrated  # noqa: E402
from flexplan.calibration.store import load_calibration  # noqa: E402
from flexplan.hardware import get_hardware  # noqa: E402

csv_path, cal_path = sys.argv[1], sys.argv[2]
gpu = sys.argv[3] if len(sys.argv) > 3 else "h200-sxm-141gb"
comp = get_hardware(f"xeon-6130+{gpu}+pcie5-x16", gpu_memory_bytes=int(1.5 * 2**30))
hw = replace(comp, cpu=replace(comp.cpu, name="Intel(R) Xeon(R) Processor", sockets=1, cores=16, memory_bytes=135 * 10**9,
                               peak_flops_per_s={"bfloat16": 34406e9, "float32": 2150e9},
                               memory_bandwidth_bytes_per_s=40e9, isa=frozenset({"avx512f", "avx512_bf16", "amx_bf16"})))
cal = load_calibration(cal_path)
model = Path.home() / ".cache/flexplan/models/random-llama-1GB-fp32"  # validate --model random-llama-1gb creates it
errs: dict[tuple[str, str], list[list[float]]] = {}
for row in csv.DictReader(open(csv_path)):
    rc.patched_probes(rc.readings(row, "probe", "before"))
    eff = _at_state_now(_calibrated(cal, hw), cal)
    q = flexplan.plan(str(model), hw, batch_size=int(row["batch_size"]), input_len=int(row["input_len"]),
                      output_len=int(row["output_len"]), dtype="bfloat16", prefill=row["prefill_policy"],
                      decode=row["decode_policy"], efficiency=eff, cpu_dtype=row["cpu_dtype"])
    mt, mp = float(row["measured_ttft_s"]), float(row["measured_tpot_s"])
    rt, rp = float(row["probe:cold_ttft_s"]), float(row["probe:cold_tpot_s"])
    print(f'{row["prefill_policy"]:20s} b{row["batch_size"]} i{row["input_len"]}: TTFT {mt * 1e3:7.1f} ms, recorded '
          f'{rt * 1e3:7.1f}, re-derived {q.ttft_s * 1e3:7.1f} | TPOT {mp * 1e3:6.1f}, recorded {rp * 1e3:6.1f}, '
          f're-derived {q.tpot_s * 1e3:6.1f}')
    for phase, m, r, n in (("prefill", mt, rt, q.ttft_s), ("decode", mp, rp, q.tpot_s)):
        e = errs.setdefault((phase, row["prefill_policy"]), [[], []])
        e[0].append(rc.pct(r, m))
        e[1].append(rc.pct(n, m))
for (phase, policy), (rec, new) in errs.items():
    print(f"{phase:8s} {policy:20s} MAPE recorded {sum(rec) / len(rec):6.1f}%  re-derived {sum(new) / len(new):6.1f}%")
