#!/usr/bin/env bash
# Tokenize FineWeb with Mistral's 32k tokenizer (the DeltaProduct setup) into data/fineweb.
#
#   scripts/prepare_fineweb.sh                                     # sample-10BT, streamed
#   SUBSET=sample-100BT MAX_TOKENS=35000000000 scripts/prepare_fineweb.sh  # 35B tokens, as DeltaProduct
#   DATASET=HuggingFaceFW/fineweb-edu SUBSET=sample-100BT scripts/prepare_fineweb.sh
#
# Needs: pip install datasets (the `train` extra) and a reachable Hub. mistralai/Mistral-7B-v0.1 is a
# gated repository: accept its licence on the Hub and `huggingface-cli login` first, or point
# TOKENIZER at a local copy of its tokenizer files.
#
# What to expect (rough planning numbers; measure a MAX_TOKENS sample on your machine first):
#   - size: SUBSET sample-10BT is ~10B GPT-2 tokens in ~15M documents (~45 GB of text), about as
#     many Mistral tokens (+/-10%); sample-100BT ~10x that; a document averages ~700 tokens.
#     MAX_TOKENS stops after that many tokens (train + val), MAX_DOCS after that many documents.
#   - disk: the vocabulary (32,000 tokens) fits uint16: 2 bytes/token, ~20 GB for sample-10BT,
#     ~200 GB for sample-100BT (plus the Hub cache if you do not stream).
#   - time: ~1-1.5 MB of text per CPU-second per worker (measured 1.3 MB/s = 380k tokens/s per core
#     with the default tokenizer): sample-10BT ~10 core-hours, ~20-40 min with 16-32 workers when
#     the download keeps up; sample-100BT ~100 core-hours.
#   - val: VAL_FRACTION=0.001 holds out every 1000th document (~10M tokens for sample-10BT).
# Interrupted? Run the same command again: finished shards are kept and it goes on from there.
set -euo pipefail

DATASET=${DATASET:-HuggingFaceFW/fineweb}
SUBSET=${SUBSET:-sample-10BT}
TOKENIZER=${TOKENIZER:-mistralai/Mistral-7B-v0.1}
OUT=${OUT:-data/fineweb-${SUBSET}}
WORKERS=${WORKERS:-$(nproc)}
VAL_FRACTION=${VAL_FRACTION:-0.001}
MAX_DOCS=${MAX_DOCS:-}
MAX_TOKENS=${MAX_TOKENS:-}

args=(--input "$DATASET" --hf-name "$SUBSET" --hf-split train --streaming --tokenizer "$TOKENIZER"
      --output "$OUT" --workers "$WORKERS" --val-fraction "$VAL_FRACTION" --text-field text)
if [[ -n "$MAX_DOCS" ]]; then
  args+=(--max-documents "$MAX_DOCS")
fi
if [[ -n "$MAX_TOKENS" ]]; then
  args+=(--max-tokens "$MAX_TOKENS")
fi
exec python -m lm.data.prepare "${args[@]}" "$@"
