#!/usr/bin/env bash
# One short script for a lent GPU machine (device tool): the GPU tests, then the GPU benchmark (the
# Triton kernel's speed: still unmeasured, so it runs second), then the checks only a GPU can run.
# Logs and CSVs under $OUT. That machine has no network: it runs the image's own python3 (torch,
# triton, transformers, pytest, hypothesis are there), imports sinkwatch from this checkout and
# installs nothing. The whole script keeps to BUDGET_S (default 480 s): each stage has its own time
# limit, never more than what is left, and a stage that cannot start with 30 s left is skipped and
# says so, so a slow stage cannot eat the lease and the results so far always come back.
#
#   device run:  bash benchmarks/gpu_check.sh        (timeout_s 540: the budget plus the machine's start)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-480} ))
status=0

# stage LOG LIMIT_S COMMAND...: run COMMAND under min(LIMIT_S, time left), its output appended to $OUT/LOG;
# a failure (or a timeout) sets status=1; skipped, with a line saying so, when under 30 s are left
stage() {
  local log=$1 limit=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 30 ]; then
    echo "skipped (${left}s of the ${BUDGET_S:-480}s budget left): $*" | tee -a "$OUT/$log"
    status=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $* (limit ${limit}s)" >> "$OUT/$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/gpu_env.txt"

# 1. realistic bf16 shapes, float32 parity, no S^2 allocation (compiled kernel vs float64 reference),
#    and a whole probe through the compiled kernel against eager attention
stage gpu_tests.txt 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_triton.py
stage gpu_tests.txt 60 python3 -m pytest -q -p no:cacheprovider \
  "tests/test_record_vs_eager.py::test_the_triton_kernel_inside_a_real_probe_matches_eager" tests/test_kernel_fallback.py

# 1b. the fused output kernel (triton_fused.py; the CUDA default keeps the model's own attention until this
#     kernel is measured faster): its small cases compiled (the realistic bf16 shapes ran in stage 1, -m gpu),
#     then a whole probe whose attention output it computes (SINKWATCH_ATTENTION_OUTPUT=fused) against eager;
#     a kernel that falls back, or an output that disagrees with the model's own, warns "sinkwatch: ...": an error here
stage gpu_fused.txt 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -k fused -m "not gpu"
stage gpu_fused.txt 60 env SINKWATCH_ATTENTION_OUTPUT=fused python3 -m pytest -q -p no:cacheprovider -W "error:sinkwatch:RuntimeWarning" \
  "tests/test_record_vs_eager.py::test_the_triton_kernel_inside_a_real_probe_matches_eager"

# 2. the benchmark (Triton vs the PyTorch path vs eager vs SDPA flash; a probe's attention with the model's
#    flash attention beside the statistics kernel vs the fused kernel: fused_over_default_time), only if the kernels are right
if [ "$status" -eq 0 ]; then
  stage bench_attention_stats.txt 180 python3 benchmarks/bench_attention_stats.py --repeat 10 --csv "$OUT/bench_attention_stats.csv"
else
  echo "GPU tests failed: benchmark skipped" | tee -a "$OUT/gpu_tests.txt"
fi

# 2b. a real model's shape: SmolLM2-135M-shaped, random init, bf16; Triton vs the PyTorch path vs eager
stage gpu_real_shape.txt 60 python3 benchmarks/gpu_real_shape.py --out "$OUT/gpu_real_shape.json"

# 3. Triton faults on CUDA: an out-of-memory keeps the kernel, a fault at the first
#    launch's sync falls back once, and a real asynchronous fault (an out-of-bounds read in a launch
#    that does not autotune) is attributed to the kernel at that sync, in a child process
stage gpu_kernel_faults.txt 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_faults.py

# 4. replay's big-model paths: loaded onto the GPU, float32 freed before the float16 PR pass,
#    the device cache emptied between revisions, a real out-of-memory retried at half batch_tokens, a model
#    split over GPUs (2+ GPUs). Replay needs tenacity, filelock and accelerate (pure Python): where the
#    image lacks them, carry a folder of them and put it on PYTHONPATH; else this stage says so and skips.
if python3 -c "import tenacity, filelock, accelerate" 2>/dev/null; then
  stage gpu_replay_check.txt 150 python3 benchmarks/gpu_replay_check.py --out "$OUT/gpu_replay_check.json"
else
  echo "replay GPU check skipped: python3 lacks tenacity/filelock/accelerate (no network here to install them)" | tee "$OUT/gpu_replay_check.txt"
fi

# 5. FSDP v1 through Lightning's FSDPStrategy (GPU only: it refuses CPU), callback at its defaults
#    (natural probe on), both use_orig_params settings, on 1 or 2 GPUs: records equal a single-process run
if ! python3 -c 'import lightning' 2>/dev/null; then
  echo "FSDP v1 Lightning runs skipped: lightning is not installed in this image" | tee "$OUT/gpu_fsdp1.txt"
elif [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 1 ]; then
  for flat in "" "--flat"; do
    fsdp_out=$(mktemp -d)
    stage gpu_fsdp1.txt 120 python3 tests/fsdp1_lightning.py "$fsdp_out" $flat
    stage gpu_fsdp1.txt 45 python3 tests/fsdp1_lightning.py --check "$fsdp_out"
  done
else
  echo "FSDP v1 Lightning runs skipped: no GPU" | tee "$OUT/gpu_fsdp1.txt"
fi

# 5b. (at most 90 s): Lightning's FSDPStrategy with bf16-mixed (FSDP parameter mixed precision: before, every run
#     stopped at the step-0 probe), and OLMo-core's default two-backend group "cpu:gloo,cuda:nccl" (a CPU-only torch
#     cannot initialise it): the matrix's olmo_fsdp2 cell over it, and the device sinkwatch's agreements pick from it
if python3 -c 'import lightning' 2>/dev/null && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 1 ]; then
  fsdp_out=$(mktemp -d)
  stage gpu_live25.txt 45 python3 tests/fsdp1_lightning.py "$fsdp_out" --bf16
  stage gpu_live25.txt 15 python3 tests/fsdp1_lightning.py --check "$fsdp_out" --bf16
else
  echo "FSDP v1 bf16-mixed Lightning run skipped: no lightning or no GPU" | tee -a "$OUT/gpu_live25.txt"
fi
if python3 -c 'import olmo_core' 2>/dev/null && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 1 ]; then
  olmo_out=$(mktemp -d)
  stage gpu_live25.txt 30 env SINKWATCH_MATRIX_BACKEND="cpu:gloo,cuda:nccl" python3 -m torch.distributed.run --nproc_per_node 2 \
    tests/parallel_matrix.py "$olmo_out" olmo_fsdp2
  stage gpu_live25.txt 10 python3 -c "
import json, sys, torch
from pathlib import Path
from sinkwatch.distributed import group_device
d = Path('$olmo_out') / 'olmo_fsdp2'
res = [json.loads((d / f'result-rank{r}.json').read_text()) for r in range(2)]
assert all(r['status'] == 'ok' for r in res), res
steps = [json.loads(l).get('step') for l in (d / 'sw' / 'records.jsonl').read_text().splitlines()]
assert steps == [0, 2, 4] and all('error' not in l for l in (d / 'sw' / 'records.jsonl').read_text().splitlines()), steps
assert group_device('cpu:gloo,cuda:nccl', 'cuda').type == 'cuda' and group_device('cpu:gloo,cuda:nccl', 'cpu').type == 'cpu'
print('olmo-core over cpu:gloo,cuda:nccl: records', steps)"
else
  echo "OLMo-core two-backend group skipped: no olmo_core or no GPU" | tee -a "$OUT/gpu_live25.txt"
fi

# 5c. (at most 90 s): a real torchtitan 0.3.0 Trainer (llama3 debug model, 4 steps, torchtitan's defaults:
#     FSDP2 + bf16 parameter mixed precision, CUDA graphs, compiled FlexAttention) built from the documented
#     `--module sinkwatch.torchtitan` command line; records at 0, 2, 4. Only where python >= 3.11, torch has the
#     FSDP API torchtitan 0.3.0 imports (>= 2.12) and torchtitan 0.3.0 is importable (carried as wheels: the image lacks it)
if ! tt_why=$(python3 benchmarks/gpu_torchtitan_check.py --requirements 2>&1); then
  echo "torchtitan Trainer run skipped: ${tt_why}" | tee "$OUT/gpu_torchtitan.txt"
elif [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -lt 1 ]; then
  echo "torchtitan Trainer run skipped: no GPU" | tee "$OUT/gpu_torchtitan.txt"
else
  tt_out=$(mktemp -d)
  stage gpu_torchtitan.txt 90 python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/gpu_torchtitan_check.py --out "$tt_out"
fi

# 5d. (at most 60 s): Megatron-core with Transformer Engine's attention (TEDotProductAttention, CUDA only): the record of
#     a GPTModel whose core attention is TE's equals the same weights' with the local attention. Only where
#     megatron-core and transformer_engine import (the image may lack them: carried as wheels, or skipped saying so)
if ! mg_why=$(python3 benchmarks/gpu_megatron_check.py --requirements 2>&1); then
  echo "Megatron TE attention check skipped: ${mg_why}" | tee "$OUT/gpu_megatron.txt"
else
  mg_out=$(mktemp -d)
  stage gpu_megatron.txt 60 python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/gpu_megatron_check.py --out "$mg_out"
fi

# 6. the interpreter's small cases, compiled this time (many autotune compiles: last, and bounded)
stage gpu_small_cases.txt 90 python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels_triton.py -m "not gpu"
exit "$status"
