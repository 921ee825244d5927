#!/usr/bin/env bash
# Tokenize the Pile with GPT-NeoX-20B's tokenizer (the implicit-LM / Pythia setup) into data/pile.
#
#   scripts/prepare_pile.sh                                  # the whole corpus, streamed from the Hub
#   MAX_TOKENS=1000000000 OUT=data/pile-1b scripts/prepare_pile.sh  # a 1B-token sample to try things first
#   INPUT='/data/pile/train/*.jsonl.zst' scripts/prepare_pile.sh   # local files (pip install zstandard)
#
# Needs: pip install datasets (the `train` extra) and a reachable Hub (or a local copy: INPUT=...).
# DATASET: the original EleutherAI/pile is no longer on the Hub; use monology/pile-uncopyrighted
# (the Pile without its copyrighted subsets) or EleutherAI/the_pile_deduplicated (the deduplicated
# "D-Pile" of Pythia-deduped and the implicit-LM paper; it has one `text` column).
#
# What to expect (rough planning numbers; measure a MAX_TOKENS sample on your machine first):
#   - size: the full Pile is ~825 GiB of text in ~210M documents, ~300B GPT-NeoX tokens; the
#     deduplicated Pile ~207B tokens in ~134M documents.
#   - disk: the vocabulary (50,277 tokens) fits uint16, so shards take 2 bytes/token: ~600 GB for
#     the full Pile, ~415 GB deduplicated (plus the Hub cache if you do not stream: ~+50-100%).
#   - time: a byte-level BPE tokenizes ~1-1.5 MB of text per CPU-second (measured 1.3 MB/s =
#     380k tokens/s per core for the default tokenizer), so ~150-200 core-hours for the full Pile:
#     ~3-6 h with 32-64 workers, when the download/decompression keeps up (streaming is often the
#     bottleneck; downloading first with `huggingface-cli download` and INPUT=... is steadier).
#   - val: VAL_FRACTION=0.0005 holds out every 2000th document (~150M tokens).
# Interrupted? Run the same command again: finished shards are kept and it goes on from there.
set -euo pipefail

DATASET=${DATASET:-monology/pile-uncopyrighted}
INPUT=${INPUT:-$DATASET}
TOKENIZER=${TOKENIZER:-EleutherAI/gpt-neox-20b}
OUT=${OUT:-data/pile}
WORKERS=${WORKERS:-$(nproc)}
VAL_FRACTION=${VAL_FRACTION:-0.0005}
MAX_DOCS=${MAX_DOCS:-}
MAX_TOKENS=${MAX_TOKENS:-}

args=(--input "$INPUT" --tokenizer "$TOKENIZER" --output "$OUT" --workers "$WORKERS"
      --val-fraction "$VAL_FRACTION" --text-field text)
if [[ "$INPUT" == "$DATASET" ]]; then
  args+=(--hf-split train --streaming)
fi
if [[ -n "$MAX_DOCS" ]]; then
  args+=(--max-documents "$MAX_DOCS")
fi
if [[ -n "$MAX_TOKENS" ]]; then
  args+=(--max-tokens "$MAX_TOKENS")
fi
exec python -m lm.data.prepare "${args[@]}" "$@"
