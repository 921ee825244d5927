"""`lm selftest` (what scripts/check_latest.sh runs on the newest releases): passes here, and reports a broken
check instead of passing it."""
import pytest

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


@pytest.mark.slow
def test_selftest_names_what_is_missing_and_reports_every_check(monkeypatch, capsys):
    """After the README's set-up (the `train` extra) lm-eval is not installed: the selftest prints each check's line
    and names the missing package with its install command instead of stopping."""
    monkeypatch.setattr(st, "missing", lambda module: module == "lm_eval")
    assert st.main(["--families", "llama"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert sum(line.startswith("ok   ") for line in lines) == 5, out  # 3 family checks, prepare-data, train
    assert any(line.startswith("skip lm-eval") and "lm-eval not installed: pip install -e '.[eval]'" in line
               for line in lines), out
    assert "5 passed, 0 failed, 1 skipped" in out
    assert "missing: lm-eval not installed: pip install -e '.[eval]'" in out


@pytest.mark.slow
def test_a_check_that_exits_is_reported_not_fatal(monkeypatch):
    def exits(*a, **k):
        raise SystemExit("lm eval needs lm-eval-harness")

    monkeypatch.setattr(st, "_lm_eval", exits)
    monkeypatch.setattr(st, "missing", lambda module: False)
    records = st.run(families=["llama"], trainer=True, lm_eval=True)
    failed = [r for r in records if not r["ok"]]
    assert [(r["what"], r["error"]) for r in failed] == [("lm-eval", "SystemExit: lm eval needs lm-eval-harness")]
    assert len(records) == 6
