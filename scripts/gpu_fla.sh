#!/bin/bash
# flash-linear-attention on a GPU machine: the fla GPU tests (backend="fla" vs "triton" on the same inputs;
# an fla model on fla's kernels vs its `lm convert` conversion, training it through `lm train`, converting
# back), then the speed of backend="triton" vs backend="fla" on the same inputs (forward, and forward +
# backward), B8 T2048 H16 K128 V256 bf16, nh 1, 2, 3, ungated and gated, printed as a table.
# Run from the repo root with .gpu prepared by ../shared/tools/gpu-carry.sh (carried to the machine):
#   bash scripts/gpu_fla.sh            (OUT: where logs go, default /tmp/fla_out; about 3 min on an H100)
#   TESTS=0 / SPEED=0 skip the tests / the table; SETS="test_model test_op_varlen" runs some test processes
set -u
OUT=${OUT:-/tmp/fla_out}; mkdir -p "$OUT"
if [ -d .gpu/wheels ]; then
  bash scripts/gpu_wheels.sh
fi
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-}
export PATH=$PWD/.gpu/site/bin:$PATH PYTHONUNBUFFERED=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
python3 -c "import torch, triton, fla, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'fla', fla.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"

# the tests first, in four processes (compiling is most of their time; 16 cores compile in parallel), then the
# speed table alone on the GPU
if [ "${TESTS:-1}" = 1 ]; then
  t=tests/test_deltaproduct_fla_gpu.py
  run() {  # name, pytest args...
    local name=$1; shift
    ( timeout 300 python3 -m pytest -m gpu "$@" -q -s -p no:cacheprovider > "$OUT/$name.log" 2>&1
      echo "exit $?" >> "$OUT/$name.log" ) &
  }
  SETS=${SETS:-"test_op_plain test_op_gated test_op_varlen test_model"}  # a subset: SETS="test_model ..."
  for f in $SETS; do
    case $f in
      test_op_plain) run $f $t -k "dense and plain" ;;
      test_op_gated) run $f $t -k "dense and gated" ;;
      test_op_varlen) run $f $t -k "varlen or float32" ;;
      test_model) run $f tests/test_convert_fla_gpu.py ;;
    esac
  done
  wait
  for f in $SETS; do
    echo "--- $f ($OUT/$f.log)"; grep -E "rel\. errors|losses|passed|failed|Error|exit" "$OUT/$f.log" | tail -30
  done
fi
[ "${SPEED:-1}" = 1 ] || exit 0
python3 - <<'PY' 2>&1 | tee "$OUT/speed.txt"
import torch
from triton.testing import do_bench

from lm_kernels.deltaproduct import chunk_deltaproduct
from lm_kernels.deltaproduct.fla_backend import hopper_backward_blocked

B, T, H, K, V = 8, 2048, 16, 128, 256
print(f"DeltaProduct chunk op, B{B} T{T} H{H} K{K} V{V} bf16 (beta, g float32 as the model passes them), "
      f"use_qk_l2norm; median ms (triton.testing.do_bench) on {torch.cuda.get_device_name()}")
print(f"{'nh':>3} {'gate':>5} | {'fwd triton':>10} {'fwd fla':>9} {'fla/triton':>10} | "
      f"{'f+b triton':>10} {'f+b fla':>9} {'fla/triton':>10}")
for gated in (False, True):
    for nh in (1, 2, 3):
        torch.manual_seed(0)
        q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, T * nh, H, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, T * nh, H, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        beta = (2 * torch.rand(B, T * nh, H, device="cuda")).requires_grad_()
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda")).requires_grad_() if gated else None
        do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

        def fwd(backend):
            with torch.no_grad():
                return chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, use_qk_l2norm=True, backend=backend)

        def fb(backend):
            o, _ = chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, use_qk_l2norm=True, backend=backend)
            o.backward(do)

        row = {}
        for name, fn in (("fwd", fwd), ("fb", fb)):
            for backend in ("triton", "fla"):
                if name == "fb" and backend == "fla" and gated and hopper_backward_blocked(q.device):
                    row[name, backend] = None  # fla refuses it here (see fla_backend.py)
                    continue
                fn(backend)  # compile / autotune outside the timing
                row[name, backend] = do_bench(lambda: fn(backend), warmup=25, rep=100, grad_to_none=[q, k, v, beta])

        def cell(x):
            return f"{x:.3f}" if x is not None else "refused"

        def ratio(a, b):
            return f"{b / a:.2f}x" if a and b else "-"
        gate = "yes" if gated else "no"
        print(f"{nh:>3} {gate:>5} | {cell(row['fwd', 'triton']):>10} {cell(row['fwd', 'fla']):>9} "
              f"{ratio(row['fwd', 'triton'], row['fwd', 'fla']):>10} | {cell(row['fb', 'triton']):>10} "
              f"{cell(row['fb', 'fla']):>9} {ratio(row['fb', 'triton'], row['fb', 'fla']):>10}")
        del q, k, v, beta, g, do
        torch.cuda.empty_cache()
print("refused: fla's gated backward on Hopper with triton in [3.4.0, 3.7.1) (fla issue #640)")
PY
