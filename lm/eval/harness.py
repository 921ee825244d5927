"""lm-eval-harness in process, on our model object and tokenizer, with the papers' table.

    lm eval CKPT --tasks lambada_openai,hellaswag,piqa,arc_easy,arc_challenge,winogrande,openbookqa
    lm eval CKPT --tasks lm_local_lastword,lm_local_continuation --include-path data/lm_tasks

Implicit models evaluate in simultaneous mode at the evaluation cap (eval_factor x max_iter). The
training hook calls `run_lm_eval` on the live model. Generation tasks (generate_until, e.g.
lm_local_generate) run the models' `generate`: a parallel prefill and, on CUDA, the CUDA-graph decode step
(`--decode eager` for the per-token Python path, to compare).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

PAPER_TASKS = ["lambada_openai", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande", "openbookqa"]
# Which accuracy the papers report per task (acc_norm where the Mamba/GLA tables use it).
REPORTED_METRIC = {"hellaswag": "acc_norm", "arc_challenge": "acc_norm", "lm_local_continuation": "acc_norm"}
LOCAL_TASKS_HINT = ("the local tasks need their data: run `python -m lm.eval.local_tasks --data data/shakespeare "
                    "--output data/lm_tasks` and pass --include-path data/lm_tasks")


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ValueError(f"lm-eval is not installed ({e}): pip install -e '.[eval]' (or pip install "
                         "'lm-eval[hf]')") from None
    return lm_eval, HFLM, TaskManager


_LOCAL_BUILDERS = {"json", "csv", "text", "parquet", "arrow"}


def _cached(dataset_path: str) -> bool:
    """Whether `datasets` holds a copy of a Hub dataset (its cache folder <org>___<name>)."""
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    cache = os.environ.get("HF_DATASETS_CACHE", os.path.join(home, "datasets"))
    return os.path.isdir(os.path.join(cache, dataset_path.replace("/", "___")))


def check_hub(needs: dict[str, str]) -> None:
    """Fail fast, in one paragraph, when tasks need datasets from the Hugging Face Hub ({task: dataset}) that
    are not cached and the Hub cannot be reached (instead of lm-eval's retries ending in a ConnectionError)."""
    needs = {t: d for t, d in needs.items() if not _cached(d)}
    if not needs or os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return
    import urllib.error
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=5).close()
    except urllib.error.HTTPError:
        return  # the Hub answered
    except (OSError, ValueError) as err:
        listed = ", ".join(f"{t} ({d})" for t, d in sorted(needs.items()))
        raise ValueError(
            f"the task(s) {listed} load their data from the Hugging Face Hub, which cannot be reached from here "
            f"({endpoint}: {getattr(err, 'reason', err)}), and the data is not in the datasets cache. Run once where "
            "the Hub is reachable (or copy the datasets cache here and set HF_DATASETS_OFFLINE=1), or evaluate on "
            f"local tasks: {LOCAL_TASKS_HINT}.") from None


def _local_task_names(include_path: str | None) -> set[str]:
    """Task names defined by the YAMLs of an include folder (read without lm-eval's full task index)."""
    names: set[str] = set()
    if include_path and Path(include_path).is_dir():
        import yaml

        for p in Path(include_path).rglob("*.yaml"):
            try:
                task = (yaml.safe_load(p.read_text()) or {}).get("task")
            except Exception:  # noqa: BLE001 - lm-eval YAMLs may use its own tags (!function)
                continue
            if isinstance(task, str):
                names.add(task)
    return names


def _builtin_dataset(task: str) -> str | None:
    """The dataset_path of lm-eval's own <task>.yaml, read without its task index (None when not found)."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    for p in Path(list(spec.submodule_search_locations)[0], "tasks").rglob(f"{task}.yaml"):
        for line in p.read_text().splitlines():
            if line.startswith("dataset_path:"):
                return line.split(":", 1)[1].strip().strip("'\"")
    return None


def hub_tasks(tasks: list[str], tm=None, include_path: str | None = None) -> dict[str, str]:
    """{task: Hub dataset} of the tasks whose data comes from the Hub. With lm-eval's TaskManager the dataset
    is read from the task's config; without one (before it is built) every task that is not a local one counts,
    named by its task name."""
    out = {}
    local = _local_task_names(include_path)
    for t in tasks:
        if t in local:
            continue
        if tm is None:
            out[t] = _builtin_dataset(t) or t
            continue
        entry = tm.task_index.get(t)
        path = (getattr(entry, "cfg", None) or {}).get("dataset_path") if entry is not None else None
        if path is None:
            continue  # a group or an unknown name: lm-eval / the check below say what is wrong
        if path in _LOCAL_BUILDERS or Path(path).exists():
            continue
        out[t] = path
    return out


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None = None):
    """lm-eval's TaskManager (indexing every task YAML takes seconds: built once per include path)."""
    _, _, TaskManager = _import_lm_eval()
    return TaskManager(include_path=include_path)


def run_lm_eval(model, tokenizer, tasks: list[str], *, num_fewshot: int = 0, batch_size: int = 16,
                limit: int | float | None = None, include_path: str | None = None,
                max_length: int | None = None, decode: str | None = None) -> dict:
    """Run lm-eval on an in-memory model; returns {"results": {task: {metric: value}}, "table": [...]}.
    `decode`: the decode path of generation tasks (lm.models.decode: auto | graph | static | eager); None =
    the model's `decode_mode`."""
    import torch

    lm_eval, HFLM, _ = _import_lm_eval()
    was_training = model.training
    old_decode = getattr(model, "decode_mode", None)
    if decode is not None and old_decode is not None:
        model.decode_mode = decode
    model.eval()
    try:
        hflm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                    max_length=max_length or getattr(model.config, "max_position_embeddings", None) or 2048,
                    device=str(next(model.parameters()).device))
        tm = task_manager(str(include_path) if include_path else None)
        missing = [t for t in tasks if t not in tm.all_tasks]
        if missing:
            hint = LOCAL_TASKS_HINT if any(t.startswith("lm_local_") for t in missing) else \
                "check the task names (lm_eval --tasks list) or pass --include-path"
            raise ValueError(f"unknown lm-eval task(s) {missing}: {hint}")
        check_hub(hub_tasks(tasks, tm, include_path))
        with torch.no_grad():
            out = lm_eval.simple_evaluate(model=hflm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          task_manager=tm, log_samples=False, bootstrap_iters=0)
    finally:
        model.train(was_training)
        if old_decode is not None:
            model.decode_mode = old_decode
            from lm.models.decode import release_decoders

            release_decoders(model)  # the static buffers / graphs of generation tasks (K/V: GBs at large B)
    results = {t: {k.split(",")[0]: v for k, v in r.items() if isinstance(v, (int, float)) and "stderr" not in k}
               for t, r in out["results"].items()}
    return {"results": results, "table": paper_table(results)}


def paper_table(results: dict) -> list[tuple[str, str, float]]:
    """(task, metric, value) rows in the papers' order: LAMBADA ppl and acc, then the accuracies."""
    rows = []
    order = [t for t in PAPER_TASKS if t in results] + sorted(t for t in results if t not in PAPER_TASKS)
    for t in order:
        r = results[t]
        if "perplexity" in r:
            rows.append((t, "ppl", r["perplexity"]))
        metric = REPORTED_METRIC.get(t, "acc")
        if metric not in r and "acc" in r:
            metric = "acc"
        if metric in r:
            rows.append((t, metric, r[metric]))
    accs = [v for t, m, v in rows if m != "ppl"]
    if accs:
        rows.append(("average", "acc", sum(accs) / len(accs)))
    return rows


def format_table(rows) -> str:
    lines = [f"{'task':28s} {'metric':9s} {'value':>10s}", "-" * 49]
    lines += [f"{t:28s} {m:9s} {v:10.4f}" for t, m, v in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lm eval", description="lm-eval-harness on an exported checkpoint")
    ap.add_argument("checkpoint", help="model folder (lm export output)")
    ap.add_argument("--tasks", default=",".join(PAPER_TASKS))
    ap.add_argument("--num-fewshot", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit", type=float, default=None, help="examples per task (debugging)")
    ap.add_argument("--include-path", default=None, help="folder of extra task YAMLs (local tasks)")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--decode", default=None, choices=[None, "auto", "graph", "static", "eager"],
                    help="decode path of generation tasks (default: the model's, a CUDA graph on CUDA)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    ap.add_argument("--output", default=None, help="results JSON (default: CKPT/eval_results.json)")
    args = ap.parse_args(argv)

    from .checkpoint import load_checkpoint, resolve_checkpoint

    tasks = [t for t in args.tasks.split(",") if t]
    try:
        resolve_checkpoint(args.checkpoint)
        # before the model and lm-eval's task index load (tens of seconds): a Hub that cannot be reached
        check_hub(hub_tasks(tasks, None, args.include_path))
        model, tok = load_checkpoint(args.checkpoint, device=args.device, dtype=args.dtype)
        limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
        t0 = time.time()
        res = run_lm_eval(model, tok, tasks, num_fewshot=args.num_fewshot, batch_size=args.batch_size, limit=limit,
                          include_path=args.include_path, max_length=args.max_length, decode=args.decode)
    except ValueError as err:
        print(f"lm eval: {err}", file=sys.stderr)
        return 2
    implicit = model.config.implicit
    res.update(checkpoint=str(resolve_checkpoint(args.checkpoint)), seconds=time.time() - t0,
               implicit=implicit.to_dict() if implicit is not None else None)
    out = Path(args.output) if args.output else resolve_checkpoint(args.checkpoint) / "eval_results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(format_table(res["table"]))
    print(f"results written to {out}")
    return 0
