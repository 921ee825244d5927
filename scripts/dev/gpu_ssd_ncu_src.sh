#!/usr/bin/env bash
# Source-level Nsight Compute profile of selected SSD kernels: scripts/dev/gpu_ssd_ncu.sh with NCU_SOURCE=1 (see there).
#   NCU_KERNELS="regex:dx_bwd"  NCU_CASES="ours="  NCU_ARGS=""  NCU_TAG=dx
NCU_SOURCE=1 exec bash "$(dirname "$0")/gpu_ssd_ncu.sh"
