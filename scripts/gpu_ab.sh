#!/usr/bin/env bash
# The same-machine A/B that precedes resolving an issue touching models, kernels or the trainer, in one device call.
#   bash scripts/gpu_ab.sh prepare OLD_COMMIT     # here: .ab/old = OLD_COMMIT's tree, .ab/new = HEAD's (both clean)
#   bash scripts/gpu_ab.sh run [PARTS]            # on the GPU machine (device tool, carry [".ab", ".gpu"]):
#       GPU tests of the new tree, then scripts/ab_bench.py old vs new (PARTS: default step,decode,kernels)
# One device command runs at most 10 minutes: the tests and the step's four cases on both trees take about that, so
# a second call runs the rest on the warm machine: SKIP_TESTS=1 bash scripts/gpu_ab.sh run decode,kernels
# The device machine gets no .git, so both trees are exported here; .gpu (../shared/tools/gpu-carry.sh .gpu) brings
# the kernels' peers (mamba_ssm's Triton SSD, fla). Results: $OUT/tests.txt, $OUT/ab.txt, $OUT/ab.json.
set -u
cmd=${1:-}
case "$cmd" in
  prepare)
    old=${2:?usage: gpu_ab.sh prepare OLD_COMMIT}
    rm -rf .ab/old .ab/new && mkdir -p .ab/old .ab/new
    git archive "$old" | tar -x -C .ab/old && git archive HEAD | tar -x -C .ab/new
    echo "prepared .ab/old ($(git rev-parse --short "$old")) and .ab/new ($(git rev-parse --short HEAD))"
    ;;
  run)
    parts=${2:-step,decode,kernels}
    OUT=${OUT:-/tmp/gpu_ab_out}
    mkdir -p "$OUT" /tmp/t
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
    peers=""
    if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl && peers=$PWD/.gpu/peers:/tmp/site
    fi
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
    [ -n "${SKIP_TESTS:-}" ] || (cd .ab/new && for f in tests/test_shape_matrix_*.py tests/test_rmsnorm_op_triton.py tests/test_models_compile_gpu.py \
        tests/test_solve_graph_gpu.py tests/test_left_padding_gpu.py tests/test_models_hybrid_gpu.py; do
      ( LM_SSD_AUTOTUNE=0 LM_CONV1D_AUTOTUNE=0 LM_RMSNORM_AUTOTUNE=0 timeout ${TEST_TIMEOUT:-300} python3 -m pytest "$f" -q \
          -p no:cacheprovider > "/tmp/t/$(basename "$f" .py).log" 2>&1; echo "rc $?" >> "/tmp/t/$(basename "$f" .py).log" ) &
    done; wait)
    if [ -z "${SKIP_TESTS:-}" ]; then
      for f in /tmp/t/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|rc " "$f" | tail -6; done | tee "$OUT/tests.txt"
      tar czf "$OUT/tests.tgz" -C /tmp t
    fi
    python3 scripts/dev/llama_dx_gemms.py | tee "$OUT/gemm.txt"
    python3 .ab/new/scripts/ab_bench.py --old .ab/old --new .ab/new --parts "$parts" --extra-path "$peers" \
        --out /tmp/ab 2>&1 | tee "$OUT/ab.txt"
    cp /tmp/ab/ab.json "$OUT/ab.json"
    ;;
  *)
    echo "usage: bash scripts/gpu_ab.sh prepare OLD_COMMIT | run [PARTS]" >&2; exit 2;;
esac
