"""The client store: persistent per-client state for all K clients (personal models, kept-local tensors,
control variates, worker momentum, error-feedback residuals ...).

Each entry is one tensor `[K, ...]`, allocated on first write and kept on `device` (the CPU by default,
so a chunk of clients can train on an accelerator while the rest of the federation waits in host memory).
A client that never wrote an entry reads its default. The store is part of the run's checkpoint
(`state_dict` holds tensors only, so it loads with `torch.load(weights_only=True)`); on Flower each
client keeps its own row in `context.state` (`row` / `put_row`)."""
from __future__ import annotations

import numpy as np
import torch


class ClientStore:
    def __init__(self, defaults: dict, num_clients: int, device="cpu"):
        self.defaults = {k: v.detach().to(device) for k, v in defaults.items()}
        self.K, self.device = int(num_clients), torch.device(device)
        self.tables: dict[str, torch.Tensor] = {}
        self.written = torch.zeros(self.K, dtype=torch.bool)

    def __bool__(self) -> bool:
        return bool(self.defaults)

    def gather(self, ids, device) -> dict:
        """{name: [m, ...]} of clients `ids` on `device` (defaults where a client has no entry yet)."""
        idx = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        out = {}
        for name, default in self.defaults.items():
            if name in self.tables:
                out[name] = self.tables[name][idx].to(device)
            else:
                out[name] = default.expand(len(idx), *default.shape).clone().to(device)
        return out

    def scatter(self, ids, values: dict) -> None:
        """Write the rows of clients `ids` (the client update's new state)."""
        idx = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        for name, value in values.items():
            if name not in self.defaults:
                raise KeyError(f"client state entry {name!r} has no default; declare it in client_state()")
            if name not in self.tables:
                d = self.defaults[name]
                self.tables[name] = d.expand(self.K, *d.shape).clone()
            self.tables[name][idx] = value.detach().to(self.device, self.tables[name].dtype)
        self.written[idx] = True

    def all(self, device) -> dict:
        """Every client's state, [K, ...] per entry (for evaluating personal models)."""
        return self.gather(np.arange(self.K), device)

    def row(self, k: int) -> dict:
        return {name: t[0] for name, t in self.gather([k], self.device).items()}

    def state_dict(self) -> dict:
        return {"tables": dict(self.tables), "written": self.written.clone()}

    def load_state_dict(self, saved: dict) -> None:
        unknown = set(saved["tables"]) - set(self.defaults)
        if unknown:
            raise ValueError(f"checkpoint's client store has entries {sorted(unknown)} this method does not declare")
        self.tables = {k: v.to(self.device) for k, v in saved["tables"].items()}
        self.written = saved["written"].clone()
