"""The contract between methods and the engine is declared (issue 40, item 2): method files never see the engine's
RoundSetup, the engine and core find hooks by declaration (no attribute or signature probing of method parts), every
class with its own local training is an `OwnTraining`, and the learning rate has one route (`client_lr`)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import torch

import fedlab_nb as fl
import fedlab_nb.methods
from fedlab_nb.core.method import LocalObjective, Method, OwnTraining
from fedlab_nb.core.optim import SGD

PACKAGE = Path(fl.__file__).parent


def test_no_method_file_sees_the_round_setup():
    leaks = [f"{p.relative_to(PACKAGE)}:{n}" for p in sorted((PACKAGE / "methods").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"RoundSetup|\bsetup\.(loss_fn|cfg|train|groups|fed|method)\b", line)]
    assert not leaks, "a method reads the engine's RoundSetup; use the LocalContext it is given:\n" + "\n".join(leaks)


def test_engine_and_core_do_not_probe_method_parts():
    """Only the engine's own loss closure (.model, .criterion) and its evaluator are looked up by name."""
    allowed = re.compile(r"getattr\((s\.)?loss_fn, \"(model|criterion|__closure__)\"|getattr\(evaluator, \"last\"")
    probes = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}"
              for folder in ("engine", "core") for p in sorted((PACKAGE / folder).glob("*.py"))
              if p.name not in ("checkpoint.py", "history.py", "groups.py", "registry.py", "rows.py")
              for n, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"hasattr\(|getattr\(|inspect\.signature", line) and not allowed.search(line)]
    assert not probes, "declare the hook in core (a base class or Protocol) instead:\n" + "\n".join(probes)


def test_every_own_local_training_is_declared():
    undeclared = []
    for info in pkgutil.walk_packages(fedlab_nb.methods.__path__, "fedlab_nb.methods."):
        for name, cls in vars(importlib.import_module(info.name)).items():
            if inspect.isclass(cls) and "local_train" in vars(cls) and not issubclass(cls, OwnTraining):
                undeclared.append(f"{info.name}.{name}")
    assert not undeclared, f"subclass core.method.OwnTraining: {undeclared}"


def test_the_learning_rate_has_one_route():
    """Under SGD(lr=...) the objective's finish, RoundInfo and the kernel all use the optimiser's rate."""
    seen = []

    class Records(LocalObjective):
        def finish(self, deltas, down, cstate, steps, lr):
            seen.append(("finish", lr))
            return {}, cstate

        def server_update(self, state, msgs, info):
            seen.append(("info", info.lr))
            return state

    fed = fl.federate("digits", "iid", n_clients=4, seed=0)
    kw = dict(model="logreg", rounds=1, clients_per_round=2, progress=False, backend="loop")
    own = fl.simulate(Method("own", Records(), optimizer=SGD(lr=0.2)), fed, lr=0.05, **kw)
    assert seen == [("finish", 0.2), ("info", 0.2)]
    run = fl.simulate(Method("run", Records()), fed, lr=0.2, **kw)   # the same step, through the run's lr
    torch.testing.assert_close(own.theta, run.theta, rtol=0, atol=0)
