"""kernels.autotune: the project's autotuners keep their choices on disk unless LM_TRITON_AUTOTUNE_CACHE=0."""
import pytest

triton = pytest.importorskip("triton")


def test_autotune_cache_switch(monkeypatch):
    from lm_kernels import autotune as at
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LM_TRITON_AUTOTUNE_CACHE", raising=False)
    cfgs = [triton.Config({"B": 16}), triton.Config({"B": 32})]

    def fn(x, B: triton.language.constexpr):
        """An empty kernel: only the autotuner built around it is inspected (never compiled or run)."""
    jitted = triton.jit(fn)
    assert at.autotune(cfgs, ["x"])(jitted).cache_results == at._HAS_CACHE
    monkeypatch.setenv("LM_TRITON_AUTOTUNE_CACHE", "0")
    assert not at.autotune(cfgs, ["x"])(jitted).cache_results
    monkeypatch.setenv("LM_TRITON_AUTOTUNE_CACHE", "yes")
    with pytest.raises(ValueError, match="LM_TRITON_AUTOTUNE_CACHE"):
        at.autotune(cfgs, ["x"])
    monkeypatch.setenv("LM_TRITON_AUTOTUNE_CACHE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not at.cache_enabled()


def test_ssd_autotuners_follow_the_switch():
    """The SSD scan's autotuners are built through kernels.autotune (cache on outside the interpreter)."""
    import lm_kernels.ssd.launch as ln
    from lm_kernels.autotune import cache_enabled
    assert ln._scan_fwd4.cache_results == cache_enabled()
