"""The config tree of the tiny training runs the training tests start (imported by the test files; pytest puts
tests/ on sys.path)."""

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "d_state": 8, "headdim": 16, "chunk_size": 16}


def tiny_run_tree(run_dir, *layers) -> dict:
    """A 6-step single-process torch-engine run of lm_mamba2-tiny at TINY sizes (one thread, lr 1e-2, no progress
    bar, one eval batch, no samples, no export), with each dict of `layers` applied in turn: a dict value updates
    the section of that name, anything else replaces it."""
    tree = {
        "run_dir": str(run_dir),
        "model": {"preset": "lm_mamba2-tiny", "overrides": dict(TINY)},
        "optim": {"lr": 1e-2},
        "train": {"steps": 6, "micro_batch_size": 2, "engine": "torch", "num_threads": 1},
        "checkpoint": {"keep_last": 3, "export": False},
        "log": {"progress": False},
        "eval": {"batches": 1, "sample_tokens": 0, "at_end": False},
    }
    for over in layers:
        for k, v in over.items():
            tree[k] = {**tree[k], **v} if isinstance(v, dict) and isinstance(tree.get(k), dict) else v
    return tree
