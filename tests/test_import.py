"""What `import lm` does: no torch, no transformers, no environment read or written; the model types registered with
transformers' Auto classes whichever comes first, `import lm` or transformers' Auto classes."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, env: dict | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_lm_loads_neither_torch_nor_transformers():
    out = _run("""
        import sys
        import lm, lm.cli
        print(sorted(m for m in ("torch", "transformers", "triton", "lm.models") if m in sys.modules))
        """)
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    import lm.models  # noqa: F401  (registration)
    from lm.models.presets import load_config
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(load_config("lm_llama-tiny")).save_pretrained(d)
    return d


@pytest.mark.parametrize("order", ["lm_first", "transformers_first", "modeling_utils_first"])
def test_auto_classes_load_lm_models_after_import_lm(saved_tiny, order):
    imports = {"lm_first": "import lm\nfrom transformers import AutoConfig, AutoModelForCausalLM",
               "transformers_first": "from transformers import AutoConfig, AutoModelForCausalLM\nimport lm",
               # transformers' modeling code loads the AutoConfig mapping while it is itself being imported
               "modeling_utils_first": "import lm\nfrom transformers import PreTrainedModel\n"
                                       "from transformers import AutoConfig, AutoModelForCausalLM"}[order]
    out = _run(imports + f"""
import sys
cfg = AutoConfig.from_pretrained({str(saved_tiny)!r})
model = AutoModelForCausalLM.from_pretrained({str(saved_tiny)!r})
print(type(cfg).__name__, type(model).__name__, any(type(f).__module__.startswith("lm.") for f in sys.meta_path))
""")
    assert out.split() == ["LMLlamaConfig", "LMLlamaForCausalLM", "False"]  # the watching finder removed itself


def test_no_environment_read_or_written_at_import():
    """Imports every module of lm and lm_kernels with os.environ replaced by a recorder; any read or
    write made from a file of lm/ or lm_kernels/ while importing is an error (what a process does is chosen per call,
    not frozen when a module is first imported). triton.jit's own read of TRITON_INTERPRET when a kernel is decorated
    is triton's (its frame is in triton's files), not ours."""
    out = _run("""
        import os, sys, pkgutil, importlib, traceback
        ours = tuple(os.path.join(os.getcwd(), p) + os.sep for p in ("lm", "lm_kernels"))
        hits = set()

        class Recorder(type(os.environ)):
            def _note(self, key):  # the innermost caller outside os / collections.abc is the reader
                for frame in reversed(traceback.extract_stack()[:-2]):
                    if not frame.filename.endswith(("os.py", "<frozen os>", "_collections_abc.py", "_collections_abc>")):
                        if frame.filename.startswith(ours):
                            hits.add(f"{os.path.relpath(frame.filename)}:{frame.lineno} {key}")
                        return
            def __getitem__(self, key):
                self._note(key); return super().__getitem__(key)
            def __setitem__(self, key, value):
                self._note(key); super().__setitem__(key, value)
            def __contains__(self, key):
                self._note(key); return super().__contains__(key)

        env = os.environ
        os.environ = Recorder(env._data, env.encodekey, env.decodekey, env.encodevalue, env.decodevalue)
        import lm, lm.cli, lm.models, lm_kernels
        mods = [m.name for m in pkgutil.walk_packages(lm.__path__, "lm.") if not m.name.endswith("__main__")]
        for m in mods + [m.name for m in pkgutil.walk_packages(lm_kernels.__path__, "lm_kernels.")]:
            try:
                importlib.import_module(m)
            except ImportError as e:  # optional peers (fla)
                if "fla" not in str(e):
                    raise
        print("\\n".join(sorted(hits)))
        """, env={"TRITON_INTERPRET": "1"})
    assert out.strip() == "", "environment read or written at import:\n" + out
