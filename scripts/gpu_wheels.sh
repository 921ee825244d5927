#!/usr/bin/env bash
# Installs the carried wheels (.gpu/wheels, made by ../shared/tools/gpu-carry.sh) into .gpu/site, once per copy of
# the tree: the GPU scripts call it first, and those run side by side on a multi-GPU machine share one install.
set -u
ls .gpu/wheels/*.whl >/dev/null 2>&1 || exit 0
mkdir -p .gpu/site
exec 9>.gpu/.install.lock
flock 9
[ -e .gpu/site/.installed ] && exit 0
python3 -m pip install -q --no-index --no-deps --upgrade --target .gpu/site .gpu/wheels/*.whl >/dev/null 2>&1 \
  && touch .gpu/site/.installed
