"""Evaluation: the global model on the global test set and on every client's local test split, and —
for methods whose clients keep their own model — each client's personal model on its own test split.

Every client is evaluated, not only the sampled ones, and the personal numbers come from the personal
models (never from the global model on client data)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from ..data.federated import FederatedDataset
from ..models import buffer_spec, param_spec, unflatten, unflatten_buffers


@torch.no_grad()
def evaluate(model: torch.nn.Module, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int = 8192,
             criterion=None, buffers: torch.Tensor | None = None):
    """(mean loss, accuracy, per-row correctness) of the flat parameters θ on (x, y), the model in eval mode
    (BatchNorm uses its running statistics: the model's own, or the flat `buffers` given, e.g. a client's).
    With a regression `criterion` the accuracy is NaN and correctness all-false."""
    params = unflatten(theta, param_spec(model))
    if buffers is not None:
        params.update(unflatten_buffers(buffers, buffer_spec(model)))
    losses, correct, width = [], [], None
    for i in range(0, len(y), chunk):
        logits = _eval_mode_call(model, params, x[i:i + chunk])
        if criterion is None:
            losses.append(F.cross_entropy(logits, y[i:i + chunk], reduction="sum"))
            correct.append(logits.argmax(1) == y[i:i + chunk])
        else:  # the sum over values, per value of a row: the loss's own mean (per entry, or one value per row)
            if width is None:
                first = criterion(logits[:1], y[i:i + 1], reduction="none")
                width = max(1, first[0].numel()) if first.dim() else 1
            losses.append(criterion(logits, y[i:i + chunk], reduction="sum") / width)
    if criterion is not None:
        return float(sum(losses) / len(y)), float("nan"), torch.zeros(len(y), dtype=torch.bool)
    correct = torch.cat(correct)
    return float(sum(losses) / len(y)), float(correct.float().mean()), correct


def _eval_mode_call(model, params, x):
    was = model.training
    model.eval()
    try:
        return functional_call(model, params, (x,))
    finally:
        model.train(was)


def _summary(prefix: str, per_client: np.ndarray) -> dict:
    return {f"{prefix}_mean": float(per_client.mean()), f"{prefix}_std": float(per_client.std()),
            f"{prefix}_p10": float(np.quantile(per_client, 0.1))}


class Evaluator:
    """Global test metrics, the distribution of per-client local-test accuracy of the global model and,
    given personal models [K, d], of each client's own model on its own split (`personal_acc_*`);
    `per_client(...)` returns the arrays behind the summaries (for `viz.client_accuracy`)."""

    def __init__(self, model, fed: FederatedDataset, criterion=None):
        self.model, self.fed, self.criterion = model, fed, criterion
        self.clients = [k for k, t in enumerate(fed.client_test) if len(t[1])]
        tests = [fed.client_test[k] for k in self.clients]
        self.client_x = torch.cat([t[0] for t in tests]) if tests else None
        self.client_y = torch.cat([t[1] for t in tests]) if tests else None
        self.owner = torch.cat([torch.full((len(t[1]),), i, device=fed.device) for i, t in enumerate(tests)]) if tests else None

    def global_local_acc(self, theta) -> np.ndarray:
        _, _, correct = evaluate(self.model, theta, self.client_x, self.client_y)
        n = torch.bincount(self.owner).float()
        return (torch.bincount(self.owner, weights=correct.float()) / n).cpu().numpy()

    def personal_acc(self, personal: torch.Tensor, buffers: torch.Tensor | None = None) -> np.ndarray:
        """Accuracy of client k's own model personal[k] on client k's test split, for every client with one
        (with its own running statistics buffers[k] when given: FedBN)."""
        dev = self.fed.device
        return np.array([evaluate(self.model, personal[k].to(dev), *self.fed.client_test[k],
                                  buffers=None if buffers is None else buffers[k].to(dev))[1] for k in self.clients])

    def __call__(self, theta, personal: torch.Tensor | None = None, buffers: torch.Tensor | None = None) -> dict:
        loss, acc, _ = evaluate(self.model, theta, self.fed.x_test, self.fed.y_test, criterion=self.criterion)
        out = {"test_loss": loss, "test_acc": acc}
        if self.client_x is not None and self.criterion is None:
            self.last = {"client": self.clients, "global model": self.global_local_acc(theta)}
            out.update(_summary("client_acc", self.last["global model"]))
            if personal is not None:
                self.last["personal model"] = self.personal_acc(personal, buffers)
                out.update(_summary("personal_acc", self.last["personal model"]))
        return out
