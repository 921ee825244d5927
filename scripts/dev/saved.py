#!/usr/bin/env python
"""What a training step keeps for its backward: the tensors autograd saves, by layer and by origin (CPU is enough).

    python scripts/dev/saved.py --preset lm_mamba2-tiny --implicit '{"max_iter": 4, "phantom_steps": 1}'
    python scripts/dev/saved.py --preset lm_deltaproduct-392m-nh2 --overrides hidden_size=128 num_heads=2 head_dim=64 \
        num_hidden_layers=2 intermediate_size=352 --seq-len 128 --triton --compile

One forward + backward of the model under `torch.autograd.graph.saved_tensors_hooks`; every saved tensor is
counted once per storage (views of one buffer share it: a saved view keeps its whole buffer alive), attributed
to the layer (Block) that saved it first ("outside" for the embedding, injection and loss), with its shape,
dtype and the op that made it (grad_fn of the saved tensor, eager only; a compiled block's saved tensors are
its graph's, without an op name). Parameters saved by their ops are not activations and are listed apart.

`--compile` compiles each block as the trainer does (`model.compile`); `--triton` runs the ops through their
Triton paths (LM_<OP>_BACKEND=triton, in the interpreter on CPU), whose autograd Functions decide what the GPU
step saves. `--dtype bf16` runs under bf16 autocast like the trainer; under the interpreter the DeltaProduct
op computes bf16 in float32 (the interpreter's bf16 dot is wrong), so its own saved tensors read 2x there:
compare float32 runs for the op, bf16 runs for the glue.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import weakref
from collections import defaultdict

OUTSIDE = "outside"


def _parse_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def build(preset: str, overrides: list[str] | None = None, implicit=None, vocab: int | None = None):
    """The model of `preset` with `key=value` overrides (values as JSON) and implicit settings, in train mode."""
    from transformers import AutoModelForCausalLM

    import lm  # noqa: F401  (registration)
    from lm.models.presets import load_config

    kw = {k: _parse_value(v) for k, v in (o.split("=", 1) for o in (overrides or []))}
    if vocab is not None:
        kw["vocab_size"] = vocab
    cfg = load_config(preset, implicit=implicit, **kw)
    return AutoModelForCausalLM.from_config(cfg).train()


class _Labeled:
    """Sets the current layer label around a block call, outside any compiled region."""

    def __init__(self, block, label: str, state: dict):
        self.block, self.label, self.state = block, label, state

    def __call__(self, *a, **k):
        prev = self.state["label"]
        self.state["label"] = self.label
        try:
            return self.block._orig_call(*a, **k)
        finally:
            self.state["label"] = prev


def saved_tensors(model, input_ids, *, compile: bool = False, dtype: str = "fp32", fused_loss: bool = True,
                  cu_seqlens=None) -> dict:
    """One forward + backward of `model` on `input_ids` (targets = the inputs shifted); returns
    {"records": [...], "params": bytes of parameters saved, "tokens": n, "layers": L}, one record per saved
    storage: label, bytes, shape, dtype, op, count (how many saves shared the storage)."""
    import torch

    state = {"label": OUTSIDE}
    layers = model.model.layers
    patched = []
    for i, block in enumerate(layers):
        if compile:
            block.compile()
        # nn.Module.__call__ is looked up on the type: route this instance through a labelling subclass
        block._orig_call = block.__class__.__call__.__get__(block)
        labeled = _Labeled(block, f"layer {i}", state)
        cls = block.__class__
        block.__class__ = type(cls.__name__, (cls,), {"__call__": lambda self, *a, _l=labeled, **k: _l(*a, **k)})
        patched.append((block, cls))

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    records: dict = {}
    param_bytes = {}

    def pack(t):
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in param_ptrs:
            param_bytes[key] = s.nbytes()
            return t
        r = records.get(key)
        # a storage is known by its address while a tensor saved on it lives: a save whose graph node was dropped
        # in the forward frees its tensor, and the allocator may hand the address to a later, different storage
        if r is None or all(ref() is None for ref in r["refs"]):
            fn = t.grad_fn
            records[key] = {"label": state["label"], "bytes": s.nbytes(), "shape": list(t.shape),
                            "dtype": str(t.dtype).replace("torch.", ""),
                            "op": type(fn).__name__ if fn is not None else ("leaf" if t.requires_grad else "-"),
                            "count": 1, "refs": [weakref.ref(t)]}
        else:
            r["count"] += 1
            r["refs"].append(weakref.ref(t))
        return t

    targets = torch.roll(input_ids, -1, dims=1)
    ctx = (torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if dtype == "bf16"
           else torch.autocast(input_ids.device.type, enabled=False))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with ctx:
                out = model(input_ids, targets=targets, fused_loss=fused_loss, cu_seqlens=cu_seqlens)
        # what the backward holds: storages with a saved tensor still alive (not those of dropped graph nodes)
        kept = [{k: v for k, v in r.items() if k != "refs"} for r in records.values()
                if any(ref() is not None for ref in r["refs"])]
        out.loss.backward()
    finally:
        for block, cls in patched:
            block.__class__ = cls
            del block._orig_call
    return {"records": kept, "params": sum(param_bytes.values()),
            "tokens": input_ids.numel(), "layers": len(layers)}


def summarize(res: dict) -> dict:
    """Bytes per label, bytes per layer per token (mean over the layers), and the largest origins of one layer."""
    by_label = defaultdict(int)
    for r in res["records"]:
        by_label[r["label"]] += r["bytes"]
    layer_labels = [k for k in by_label if k != OUTSIDE]
    n = max(1, res["layers"])
    per_layer = sum(by_label[k] for k in layer_labels) / n
    return {"total": sum(by_label.values()), "by_label": dict(by_label), "per_layer": per_layer,
            "per_layer_per_token": per_layer / res["tokens"], "outside": by_label.get(OUTSIDE, 0),
            "params_saved": res["params"], "tokens": res["tokens"]}


def origins(res: dict, label: str) -> list[dict]:
    """The saved storages of one label, grouped by (shape, dtype, op), largest first."""
    g = defaultdict(lambda: {"bytes": 0, "n": 0, "saves": 0})
    for r in res["records"]:
        if r["label"] == label:
            k = (tuple(r["shape"]), r["dtype"], r["op"])
            g[k]["bytes"] += r["bytes"]
            g[k]["n"] += 1
            g[k]["saves"] += r["count"]
    rows = [{"shape": list(k[0]), "dtype": k[1], "op": k[2], **v} for k, v in g.items()]
    return sorted(rows, key=lambda r: -r["bytes"])


def report(res: dict, title: str = "") -> str:
    s = summarize(res)
    tok = s["tokens"]
    lines = [f"{title}saved for backward: {s['total'] / 1e6:.3f} MB total over {tok} tokens; per layer "
             f"{s['per_layer'] / 1e6:.3f} MB = {s['per_layer_per_token']:.0f} B/token; outside the layers "
             f"{s['outside'] / 1e6:.3f} MB ({s['outside'] / tok:.0f} B/token); parameters saved by their ops "
             f"(not counted) {s['params_saved'] / 1e6:.3f} MB"]
    for label in (OUTSIDE, "layer 0"):
        rows = origins(res, label)
        if not rows:
            continue
        lines.append(f"  {label}: {s['by_label'].get(label, 0) / tok:.0f} B/token")
        for r in rows:
            lines.append(f"    {r['bytes'] / tok:10.1f} B/token  {r['n']:3d} x {str(tuple(r['shape'])):24s} "
                         f"{r['dtype']:9s} {r['op']}" + (f"  ({r['saves']} saves)" if r['saves'] > r['n'] else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, help="model preset name or config path")
    ap.add_argument("--overrides", nargs="*", default=[], help="config overrides key=value (value as JSON)")
    ap.add_argument("--implicit", default=None, help="implicit settings as JSON, e.g. '{\"max_iter\": 4}'")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size (small: the head is not the question)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--packed", type=int, default=0, help="pack the batch into one row of this many documents")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--compile", action="store_true", help="compile each block (as model.compile in the trainer)")
    ap.add_argument("--triton", action="store_true", help="the ops' Triton paths (interpreter on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the records and the summary here")
    args = ap.parse_args()
    if args.triton and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            return subprocess.call([sys.executable, __file__, *sys.argv[1:]], env=env)
    if args.triton:
        for op in ("SSD", "CONV1D", "DELTAPRODUCT", "LRU"):
            os.environ.setdefault(f"LM_{op}_BACKEND", "triton")
    import torch

    torch.manual_seed(args.seed)
    model = build(args.preset, args.overrides, json.loads(args.implicit) if args.implicit else None, args.vocab)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(dev)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=dev)
    cu = None
    if args.packed:
        ids = ids.reshape(1, -1)
        n = ids.shape[1]
        cuts = sorted(torch.randperm(n - 1)[: args.packed - 1].add(1).tolist())
        cu = torch.tensor([0, *cuts, n], dtype=torch.int32, device=dev)
    res = saved_tensors(model, ids, compile=args.compile, dtype=args.dtype, cu_seqlens=cu)
    title = (f"{args.preset} {' '.join(args.overrides)} {'implicit ' + args.implicit if args.implicit else 'explicit'}"
             f" {args.dtype}{' compiled' if args.compile else ' eager'}{' triton' if args.triton else ''}\n")
    print(report(res, title))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summarize(res), "records": res["records"]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
