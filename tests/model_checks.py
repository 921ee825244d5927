"""Checks shared by the model-family tests (imported by the test files; pytest puts tests/ on sys.path)."""
import torch


def overfit_losses(model, ids, steps: int = 30, lr: float = 1e-2) -> list[float]:
    """Losses of `steps` AdamW steps on one batch (labels = ids)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
