"""An fla GatedDeltaProduct model on fla's own kernels vs its `lm convert --from fla` conversion on ours (GPU):
logits within bf16 noise; then a few training steps of the conversion through `lm train` (model.init_from),
and the trained run converted back with `lm convert --to fla` loads in fla with the same logits."""
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install 'lm[fla]')")

from transformers import AutoModelForCausalLM  # noqa: E402

import lm  # noqa: E402,F401
from lm.cli import main as lm_main  # noqa: E402

VOCAB = 512


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fla_model():
    from fla.models import GatedDeltaProductConfig, GatedDeltaProductForCausalLM

    cfg = GatedDeltaProductConfig(hidden_size=256, num_heads=4, head_dim=64, expand_v=2.0, num_hidden_layers=2,
                                  vocab_size=VOCAB, num_householder=2, use_forget_gate=True, use_output_gate=True,
                                  allow_neg_eigval=True, hidden_ratio=4, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return GatedDeltaProductForCausalLM(cfg)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_fla_kernels_vs_lm_conversion_then_train(tmp_path):
    fla_model = _fla_model()
    fla_model.save_pretrained(tmp_path / "fla")
    assert lm_main(["convert", "--from", "fla", str(tmp_path / "fla"), "--output", str(tmp_path / "lm")]) == 0

    ids = torch.randint(3, VOCAB, (2, 256), device="cuda")  # > 64 tokens: fla's layer takes its chunk kernel
    theirs = _logits(fla_model.to("cuda", torch.bfloat16).eval(), ids)
    ours_bf16 = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "lm", dtype=torch.bfloat16).cuda().eval(), ids)
    ours_f32 = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "lm", dtype=torch.float32).cuda().eval(), ids)
    err = {"fla bf16 vs lm bf16": _rel(theirs, ours_bf16), "fla bf16 vs lm fp32": _rel(theirs, ours_f32),
           "lm bf16 vs lm fp32": _rel(ours_bf16, ours_f32)}
    print("\nlogit rel. errors:", {k: f"{v:.2e}" for k, v in err.items()},
          f"max abs fla-lm (bf16) {(theirs - ours_bf16).abs().max().item():.3e}")
    # bf16 noise: fla's distance from the float32 model is of the size of our own bf16 run's
    assert err["fla bf16 vs lm fp32"] < max(3 * err["lm bf16 vs lm fp32"], 1e-2), err
    assert err["fla bf16 vs lm bf16"] < 3e-2, err

    run = tmp_path / "run"
    rc = lm_main(["train", f"run_dir={run}", f"model.init_from={tmp_path / 'lm'}", "data.source=synthetic",
                  "curriculum=null", f"data.synthetic_vocab={VOCAB}", "data.seq_len=128", "train.tokens=null",
                  "train.steps=4", "train.micro_batch_size=4",
                  "train.global_batch_tokens=512", "train.precision=bf16", "train.engine=torch", "train.device=cuda",
                  "optim.lr=1e-3", "schedule.warmup=1", "log.progress=false", "eval.at_end=false",
                  "eval.sample_tokens=0", "checkpoint.export=false"])
    assert rc == 0
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    losses = [r["loss"] for r in records if "event" not in r and r.get("loss") is not None]
    print("training losses:", [round(x, 4) for x in losses])
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))

    assert lm_main(["convert", "--to", "fla", str(run), "--output", str(tmp_path / "back")]) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.bfloat16).cuda().eval()
    assert type(back).__name__ == "GatedDeltaProductForCausalLM"
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)  # fla's, fp32 weights
    assert not torch.equal(trained.model.embeddings.weight, fla_model.model.embeddings.weight.float().cpu())
    from lm.train.export import export_checkpoint

    ours_trained = AutoModelForCausalLM.from_pretrained(export_checkpoint(run, tmp_path / "hf"),
                                                        dtype=torch.bfloat16).cuda().eval()
    e = _rel(_logits(back, ids), _logits(ours_trained, ids))
    print(f"trained model, fla vs lm logits rel. error (bf16): {e:.2e}")
    assert e < 3e-2
