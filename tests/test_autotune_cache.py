"""lm_kernels.autotune: the project's autotuners keep their choices on disk unless LM_TRITON_AUTOTUNE_CACHE=0, and
each kernel module builds its autotuners for the settings read on each call (interpreter, LM_<OP>_AUTOTUNE, the disk
cache), not for those of the moment it was imported."""
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
    assert at.cache_enabled() == at._HAS_CACHE
    assert at.autotune(cfgs, ["x"], cache=at.cache_enabled())(jitted).cache_results == at._HAS_CACHE
    monkeypatch.setenv("LM_TRITON_AUTOTUNE_CACHE", "0")
    assert not at.cache_enabled() and not at.autotune(cfgs, ["x"], cache=False)(jitted).cache_results
    monkeypatch.setenv("LM_TRITON_AUTOTUNE_CACHE", "yes")
    with pytest.raises(ValueError, match="LM_TRITON_AUTOTUNE_CACHE"):
        at.tuning("ssd")
    monkeypatch.setenv("LM_TRITON_AUTOTUNE_CACHE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not at.cache_enabled()


def _names(configs):
    return [(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in configs]


@pytest.mark.parametrize("interpret, autotune_var", [("1", None), (None, None), (None, "0")])
def test_settings_read_per_call(monkeypatch, interpret, autotune_var):
    """The SSD, conv1d and gated norm autotuners for the settings of the moment of the call, changed after the
    modules were imported: the whole lists on the GPU (the disk cache as LM_TRITON_AUTOTUNE_CACHE says), the first
    config with LM_<OP>_AUTOTUNE=0, the interpreter's small configs under TRITON_INTERPRET=1 (the two SSD scans: the
    last of their lists). Only the autotuners are built here, nothing is launched."""
    import lm_kernels.conv1d.triton_conv1d as cv
    import lm_kernels.rmsnorm.triton_rmsnorm as rn
    import lm_kernels.ssd.launch as ln
    from lm_kernels import autotune as at
    for var, value in (("TRITON_INTERPRET", interpret), ("LM_SSD_AUTOTUNE", autotune_var),
                       ("LM_CONV1D_AUTOTUNE", autotune_var), ("LM_RMSNORM_AUTOTUNE", autotune_var),
                       ("LM_TRITON_AUTOTUNE_CACHE", "0")):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    tn = ln.tuners()
    fwd, bwd = cv._tuners()
    norm = rn._bwd_kernel(64)
    assert tn is ln.tuners() and fwd is cv._tuners()[0]  # built once per settings
    assert not tn.scan_fwd2.cache_results
    if interpret:
        assert _names(tn.scan_fwd2.configs) == _names(ln._SCAN_FWD2_CFGS[-1:])
        assert _names(tn.scan_fwd4.configs) == _names(ln._SCAN_FWD4_CFGS[-1:])
        assert _names(tn.dtcb_fwd.configs) == _names(ln._DTCB_FWD[0][:1])
        assert _names(fwd.configs) == [((("BC", 16), ("BT", 8)), 1, 2)] and _names(bwd.configs) == [((("BC", 32),), 1, 1)]
        assert _names(norm.configs) == [((("BR", 2),), 1, 3)]
    elif autotune_var == "0":
        assert _names(tn.scan_fwd2.configs) == _names(ln._SCAN_FWD2_CFGS[:1])
        assert _names(tn.scan_fwd4.configs) == _names(ln._SCAN_FWD4_CFGS[:1])
        assert _names(tn.state_fwd.configs) == _names(ln._STATE_FWD[0][:1])
        assert len(fwd.configs) == 1 and len(bwd.configs) == 1 and len(norm.configs) == 1
    else:
        assert _names(tn.scan_fwd2.configs) == _names(ln._SCAN_FWD2_CFGS)
        assert _names(tn.scan_fwd4.configs) == _names(ln._SCAN_FWD4_CFGS[:-1])
        assert _names(tn.dx_bwd.configs) == _names(ln._DX_BWD[0])
        assert len(fwd.configs) == 5 and len(bwd.configs) == 2 and len(norm.configs) > 1
        monkeypatch.setenv("LM_TRITON_AUTOTUNE_CACHE", "1")
        assert ln.tuners().scan_fwd4.cache_results == at._HAS_CACHE  # the cache switch, read at this call
