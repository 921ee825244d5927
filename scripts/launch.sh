#!/usr/bin/env bash
# Multi-GPU / multi-node launch of `lm train` (python -m lm.train) with DeepSpeed's launcher or torchrun.
#
#   scripts/launch.sh deepspeed CONFIG.yaml [key=value ...]    # hosts from HOSTFILE (default ./hostfile:
#                                                               #   "node-1 slots=8" per line; pdsh/ssh)
#   scripts/launch.sh torchrun  CONFIG.yaml [key=value ...]    # run the same command on every node
#   NODE_RANK=i scripts/launch.sh deepspeed CONFIG.yaml ...     # hostfile, no pdsh/ssh: run it on every node
#                                                               #   (i = the node's line in the hostfile, from 0)
#
# Environment (defaults in brackets):
#   GPUS_PER_NODE [number of visible GPUs]   NNODES [1]   NODE_RANK [unset] (torchrun / deepspeed --no_ssh; per node)
#   MASTER_ADDR [127.0.0.1 / first host]     MASTER_PORT [29500]       HOSTFILE [hostfile]
#   RDZV_ID [lm-<config name>] (torchrun)    LAUNCHER_ARGS [] extra launcher flags
# Single node: `scripts/launch.sh torchrun configs/train/dpile-mamba2-130m.yaml` (or `deepspeed` without
# a hostfile). Checkpoints must be on a file system every node sees (run_dir); resume with --resume.
set -euo pipefail

usage() { sed -n '2,16p' "$0"; exit 2; }
[ $# -ge 2 ] || usage
launcher=$1; shift
config=$1; shift
[ -f "$config" ] || { echo "launch.sh: config $config not found" >&2; exit 2; }

gpus=${GPUS_PER_NODE:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')}
nnodes=${NNODES:-1}
port=${MASTER_PORT:-29500}
hostfile=${HOSTFILE:-hostfile}
# CPU threads per rank: this node's cores shared by its ranks (the GPUs do the work; data loading and the
# optimizer's host side use a few), unless OMP_NUM_THREADS is set
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / gpus > 0 ? cores / gpus : 1 ))}

case "$launcher" in
  deepspeed)
    if [ -f "$hostfile" ]; then
      addr=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$hostfile")}
      nnodes=$(awk 'NF && $1 !~ /^#/' "$hostfile" | wc -l)
      set -x
      # NODE_RANK set: this node's ranks only (deepspeed --no_ssh), the same command started on every node
      exec deepspeed --hostfile "$hostfile" --num_nodes "$nnodes" --num_gpus "$gpus" \
        ${NODE_RANK:+--no_ssh --node_rank "$NODE_RANK"} \
        --master_addr "$addr" --master_port "$port" ${LAUNCHER_ARGS:-} \
        --module lm.train "$config" "$@"
    else
      set -x
      exec deepspeed --num_gpus "$gpus" --master_port "$port" ${LAUNCHER_ARGS:-} --module lm.train "$config" "$@"
    fi
    ;;
  torchrun)
    addr=${MASTER_ADDR:-127.0.0.1}
    rdzv_id=${RDZV_ID:-lm-$(basename "$config" .yaml)}
    set -x
    exec torchrun --nnodes "$nnodes" --nproc_per_node "$gpus" --rdzv_backend c10d \
      --rdzv_endpoint "$addr:$port" --rdzv_id "$rdzv_id" ${NODE_RANK:+--node_rank "$NODE_RANK"} \
      ${LAUNCHER_ARGS:-} -m lm.train "$config" "$@"
    ;;
  *)
    echo "launch.sh: launcher must be deepspeed or torchrun (got $launcher)" >&2
    usage
    ;;
esac
