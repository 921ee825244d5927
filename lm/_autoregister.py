"""Register lm's model types with transformers' Auto classes when those classes are first imported.

Registering needs the model classes, and importing them loads torch, transformers' modeling code and the kernels
(seconds). `import lm` should not pay that: a data-preparation worker, `lm --help` or a script that only reads
configs never touches a model. transformers resolves every model type through the AutoConfig mapping
(`transformers.models.auto.configuration_auto`), which AutoConfig, AutoModel*, AutoTokenizer and pipelines import
first; so `install()` (called by `import lm`) registers

- at once, when that module is already imported;
- otherwise right after the first import statement that brings it in has finished loading transformers' modules
  (a finder on `sys.meta_path` watches transformers' module loads until then and removes itself after).

Registering in the middle of that import would re-enter transformers' partly loaded modules (its modeling code
imports the AutoConfig mapping while it is itself being loaded), hence "after the outermost transformers module of
the import statement has loaded". `import lm.models` registers too, by any path; the finder then has nothing to do.
"""
from __future__ import annotations

import importlib.abc
import sys
import threading

AUTO_CONFIG_MODULE = "transformers.models.auto.configuration_auto"
_depth = threading.local()  # transformers modules being loaded by this thread's current import statement


def _is_transformers(name: str) -> bool:
    return name == "transformers" or name.startswith("transformers.")


def _register() -> None:
    uninstall()
    if "lm.models" not in sys.modules:
        import lm.models  # noqa: F401  (registers every model type)


class _RegisterAfterAutoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands back the spec the other finders give for a transformers module, with its
    exec_module wrapped to count this thread's nesting of transformers module loads, so that the registration runs
    when the outermost one has finished and the AutoConfig mapping is loaded."""

    def find_spec(self, name, path, target=None):
        if not _is_transformers(name):
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module):
            _depth.n = getattr(_depth, "n", 0) + 1
            try:
                exec_module(module)
            finally:
                _depth.n -= 1
            if _depth.n == 0 and AUTO_CONFIG_MODULE in sys.modules and "lm.models" not in sys.modules:
                _register()

        try:
            loader.exec_module = exec_then_register
        except AttributeError:  # a loader that takes no attributes: this module is not watched
            pass
        return spec


_FINDER = _RegisterAfterAutoImport()


def install() -> None:
    """Register now if transformers' AutoConfig mapping is loaded, else when it is (see the module docstring)."""
    if "lm.models" in sys.modules:
        return
    auto = sys.modules.get(AUTO_CONFIG_MODULE)
    if auto is not None and not getattr(getattr(auto, "__spec__", None), "_initializing", False):
        _register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
