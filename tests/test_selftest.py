"""`lm selftest` (what scripts/check_latest.sh runs on the newest releases): passes here, and reports a broken
check instead of passing it."""
import lm.selftest as st


def test_selftest_passes_on_this_install():
    records = st.run(families=["mamba2", "deltaproduct"], lm_eval=False)
    assert [r for r in records if not r["ok"]] == []
    assert {(r["what"], r["check"]) for r in records} >= {("mamba2", "generate"), ("deltaproduct", "save/load"),
                                                          ("trainer", "train 2 steps + export")}


def test_selftest_reports_a_broken_forward(monkeypatch):
    from lm.models.modeling import LMForCausalLM

    def broken(self, *a, **k):
        raise TypeError("LMOutput.__init__() got an unexpected keyword argument 'cache'")

    monkeypatch.setattr(LMForCausalLM, "forward", broken)
    records = st.run(families=["llama"], trainer=False, lm_eval=False)
    failed = {r["check"]: r["error"] for r in records if not r["ok"]}
    assert set(failed) == {"forward+backward", "generate", "save/load"}
    assert "unexpected keyword argument 'cache'" in failed["forward+backward"]
