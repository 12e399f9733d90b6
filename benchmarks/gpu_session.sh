#!/usr/bin/env bash
# One call on a lent GPU machine (the workplace's `device` tool): install, CUDA tests, calibrate
# (first-use probe, then --quick), validate the GPU policies on a model forced over its GPU
# budget with each calibration, then the gpu-offload benchmark and the full suite if time is left.
# Every step is bounded by its own limit and by the call's deadline (DEADLINE_S after the start,
# under the device call's 600 s); results land in $OUT (log.txt, gpu_results.tgz).
#
#   bash benchmarks/gpu_session.sh            # STEPS="serve quant tests probe val quick valq" by default
#   (serve: the serving engine's CUDA tests (tests/test_serving_cuda.py) and `flexplan serve` on the
#   GPU answering the openai client (tests/test_serving_server.py); quant: compressed weights on the
#   GPU (torch dequantisation of GGUF blocks, a GGUF model moved to CUDA); both never run on a GPU yet.
#   Also: attn, the CPU's bf16 decode attention, native kernel against SDPA, ~20 s; bench
#   (after val); probeprof, a second first-use probe under cProfile (~50 s); valsp, split-points
#   validated alone; full)
#   STEPS="val bench" bash benchmarks/gpu_session.sh
#
# Seen on the H200 host (16-core Xeon, 300 MiB L3, 2026-11-26): CUDA tests 30-40 s, the first-use
# probe 43-52 s, validate of the three GPU policies ~55 s, the 13.5 GB benchmark model's creation
# ~55 s; calibrate --quick did not finish in 200 s (its real layers took 124 s per dtype cycling 4x
# the L3 of weights). On the H100 host (same CPU, 2026-11-26): CUDA tests 27 s, probe 33-36 s and
# once 46 s of steps (cut at the old 60 s limit), quick at 2x the L3 still cut at 270 s (bfloat16
# real layers 88 s, executor layers 51 s). H200 again (session 8): CUDA tests 37 s, probe 35-53 s,
# the benchmark 131 s, quick cut at 191 s after its bfloat16 steps (real layers 71 s, executor
# layers 89 s); a machine starts in ~30 s. H100 (session 10): quick finished in 253 s (bfloat16 real
# layers 68 s, executor layers 80 s; float32 34 s and 38 s). Steps print their seconds as they end.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT/res"
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}
STEPS=${STEPS:-"serve quant tests probe val quick valq"}
BENCH_FLAGS=${BENCH_FLAGS:---no-accelerate}
GRID=${GRID:-"b=1,8 i=32,256 o=16"}
GPU_GIB=${GPU_GIB:-1.5}  # random-llama-1gb: gpu needs 1.8 GiB, gpu-offload 1.3, partial 1.4, splitgen 1.2
POLICIES=${POLICIES:-gpu-offload,gpu-offload-partial,splitgen}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# calibrations written here are the ones in use (the newest wins); nothing else is looked up first
export FLEXPLAN_CALIBRATION_DIR="$OUT/res/calibration"
mkdir -p "$FLEXPLAN_CALIBRATION_DIR"
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
FLEXPLAN="python3 -m flexplan.cli"
pack() { tar czf "$OUT/gpu_results.tgz" -C "$OUT" res; }
step() { echo; echo "=== $(date +%T) (+$(( $(date +%s) - T0 )) s) $*"; }
# limit LIMIT_S: the step's limit, cut to what the deadline leaves (at least 1: `timeout 0` never stops)
limit() { local left=$(( DEADLINE_S - ($(date +%s) - T0) )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }
cal_file() { ls -t "$FLEXPLAN_CALIBRATION_DIR"/*.yaml 2>/dev/null | grep -v corrections | grep "$1" | head -1; }
validate() {  # validate NAME SETS LIMIT [POLICIES]
  local s pol=${4:-$POLICIES}; s=$(limit "$3"); (( s < 20 )) && { echo "validate $1 skipped: $s s left"; return; }
  step "validate $pol, GPU budget $GPU_GIB GiB, calibrations $2 (limit $s s)"
  timeout "$s" $FLEXPLAN validate --model random-llama-1gb --accelerator cuda --gpu-memory "$GPU_GIB" \
    --policies "$pol" --grid "$GRID" --repeats 2 --calibrations "$2" \
    --out "$OUT/res/validate-$1" --no-plot > "$OUT/res/validate-$1.txt" 2>&1
  echo "rc $?"; tail -45 "$OUT/res/validate-$1.txt"; pack
}

{
step env
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3" | cut -c1-200
free -g | head -2
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

step install
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
python3 -c "import flexplan; print('flexplan from', flexplan.__file__)" || exit 1

if has serve; then
  step "serving engine on the GPU"
  timeout "$(limit 90)" python3 -m pytest -q -p no:cacheprovider tests/test_serving_cuda.py tests/test_serving_server.py tests/test_serving_compressed.py \
    > "$OUT/res/serving_cuda_tests.txt" 2>&1
  tail -15 "$OUT/res/serving_cuda_tests.txt"; pack
fi

if has quant; then
  step "compressed weights on the GPU"
  timeout "$(limit 180)" python3 -m pytest -q -p no:cacheprovider tests/test_quant_torch_dequant.py tests/test_quant_fused_dequant.py \
    tests/test_quant_model.py tests/test_quant_policies.py -k "cuda or accelerator or k_quant" > "$OUT/res/quant_cuda_tests.txt" 2>&1
  tail -15 "$OUT/res/quant_cuda_tests.txt"; pack
fi

if has tests; then
  step "CUDA tests"
  timeout "$(limit 75)" python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_executor_cuda.py > "$OUT/res/cuda_tests.txt" 2>&1
  tail -25 "$OUT/res/cuda_tests.txt"; pack
fi

if has attn; then
  step "bench_cpu_attention_bf16 (the host CPU's decode attention over a bf16 cache)"
  timeout "$(limit 60)" python3 benchmarks/bench_cpu_attention_bf16.py --rounds 3 2>&1 | tail -12
  cp benchmarks/results/bench_cpu_attention_bf16.json "$OUT/res/" 2>/dev/null; pack
fi

if has probe; then
  step "calibrate --probe (the first-use probe, GPU steps included)"
  timeout "$(limit 90)" $FLEXPLAN calibrate --probe --no-progress 2>&1 | tail -45; pack
  step "flexplan hw"
  timeout "$(limit 30)" $FLEXPLAN hw 2>&1 | tail -30
fi
PROBE=$(cal_file "")
# EXTRA_CALS: more name=path sets priced beside it (e.g. an earlier call's probe file, re-derived)
has val && [ -n "$PROBE" ] && validate probe "probe=$PROBE${EXTRA_CALS:+,$EXTRA_CALS}" 150

if has bench; then
  s=$(limit 200); step "bench_gpu_offload (limit $s s)"
  (( s >= 20 )) && timeout "$s" python3 benchmarks/bench_gpu_offload.py --repeats 1 $BENCH_FLAGS 2>&1 | tail -30
  cp benchmarks/results/bench_gpu_offload*.json "$OUT/res/" 2>/dev/null; pack
fi
# valsp: split-points on its own (its own run, so a failure there leaves the other policies' figures)
has valsp && [ -n "$PROBE" ] && validate split-points "probe=$PROBE" 90 split-points

if has probeprof; then  # where the first-use probe's seconds go on this host (a second probe, profiled)
  step "calibrate --probe under cProfile (a file apart from the one in use)"
  timeout "$(limit 90)" python3 -m cProfile -o "$OUT/res/probe.prof" -m flexplan.cli calibrate --probe --no-progress \
    --out "$OUT/res/probe_profiled.yaml" 2>&1 | grep -E "^calibrate:|^wrote"
  python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(60); s.sort_stats('tottime').print_stats(25)" \
    "$OUT/res/probe.prof" > "$OUT/res/probe_profile.txt" 2>&1
  grep -E "microbench|membw|first_use|pack|__init__|import|linear|gemv|cpu_decode|time_call|_probe_now" "$OUT/res/probe_profile.txt" | head -40; pack
fi

if has quick; then
  s=$(limit ${QUICK_S:-280})
  step "calibrate --quick (limit $s s)"
  # its own file: under the machine's name it would replace the probe's (session 10's call 1 did)
  (( s >= 20 )) && timeout "$s" $FLEXPLAN calibrate --quick --no-progress --out "$OUT/res/quick.yaml" 2>&1 | tail -60; pack
fi
# QUICK_FILE: a quick calibration of an earlier call (carried in the working tree)
QUICK=${QUICK_FILE:-$OUT/res/quick.yaml}; [ -f "$QUICK" ] || QUICK=""
has valq && [ -n "$QUICK" ] && validate quick "quick=$QUICK${PROBE:+,probe=$PROBE}" 150

if has full; then
  s=$(limit 100); step "full test suite (xdist, limit $s s)"
  # -v: each result named as it ends (a run cut at its limit still names its failures)
  (( s >= 20 )) && timeout "$s" python3 -m pytest -v -p no:cacheprovider -n 14 tests > "$OUT/res/full_suite.txt" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$OUT/res/full_suite.txt" | tail -30; pack
fi
step done
} 2>&1 | tee "$OUT/log.txt"
pack
