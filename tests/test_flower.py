"""fedlab_nb methods on Flower: same seed → same History as the in-process engine, in Flower's simulation
runtime and on a real SuperLink + 3 SuperNodes; clear errors for what cannot run there."""
from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fedlab_nb as fl
from fedlab_nb.engine.history import History
from fedlab_nb.methods import Method, fedavg, scaffold

pytestmark = pytest.mark.flower
pytest.importorskip("flwr")
from fedlab_nb.flower import run_on_flower, to_flower  # noqa: E402

try:
    from fedlab_nb.methods.robustness.rules import coordinate_median
except ImportError:  # the robust module is optional for this test
    def coordinate_median(updates, weights=None):
        return updates.median(0).values

ROOT = Path(__file__).resolve().parents[1]
RUN = dict(model="logreg", rounds=2, clients_per_round=2, local_epochs=1, batch_size=32, lr=0.1, seed=0)
ONE_CPU = {"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}}  # one Ray worker: fast start
COLUMNS = ["train_loss", "test_loss", "test_acc", "client_acc_mean"]
TOL = 1e-6  # float32 noise allowance; the same ops on the same inputs give identical numbers in practice


@pytest.fixture(scope="module")
def fed3():
    return fl.federate("digits", "dirichlet", n_clients=3, alpha=0.5, seed=0, min_size=20)


def median_method() -> Method:
    return Method("median", rule=coordinate_median)


def assert_same_history(a: History, b: History):
    assert list(b["round"]) == list(a["round"]) and list(b["n_sampled"]) == list(a["n_sampled"])
    np.testing.assert_allclose(b[COLUMNS].to_numpy(float), a[COLUMNS].to_numpy(float), rtol=0, atol=TOL)
    assert float((a.theta - b.theta).abs().max()) <= TOL


# --- the simulation runtime (Ray) ---------------------------------------------------------------------
@pytest.mark.parametrize("make", [fedavg, scaffold, median_method], ids=["fedavg", "scaffold", "median"])
def test_flower_simulation_equals_in_process(fed3, make):
    # 2 of 3 clients per round for 2 rounds: some client takes part twice, so SCAFFOLD's c_k must
    # survive between rounds in the ClientApp's context.state for the histories to match
    a = fl.simulate(make(), fed3, backend="loop", progress=False, **RUN)
    b = run_on_flower(make(), fed3, backend_config=ONE_CPU, **RUN)
    assert b.meta["runtime"] == "flower-simulation" and b.meta["method"] == a.meta["method"]
    assert_same_history(a, b)


# --- bad input ------------------------------------------------------------------------------------------
def test_rejects_what_cannot_run_on_flower(fed3):
    with pytest.raises(ValueError, match="closed-form"):
        to_flower(lambda fed: None, fed3, **RUN)  # e.g. a one-shot function like AFL
    flagged = fedavg()
    flagged.flower_compatible = False
    with pytest.raises(ValueError, match="flower_compatible=False"):
        to_flower(flagged, fed3, **RUN)
    with pytest.raises(ValueError, match="unknown method"):
        to_flower("fedavgg", fed3, **RUN)
    with pytest.raises(ValueError, match="rounds"):
        to_flower("fedavg", fed3, **{**RUN, "rounds": 0})
    with pytest.raises(TypeError, match="FederatedDataset"):
        to_flower("fedavg", "digits", **RUN)


def test_missing_flwr_gives_one_line_install_hint(monkeypatch):
    monkeypatch.delitem(sys.modules, "fedlab_nb.flower")
    for name in [m for m in list(sys.modules) if m == "flwr" or m.startswith("flwr.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "flwr", None)
    with pytest.raises(ImportError) as err:
        importlib.import_module("fedlab_nb.flower")
    assert str(err.value).count("\n") == 0 and 'pip install "fedlab_nb[flower]"' in str(err.value)


def test_to_flower_returns_flower_apps(fed3):
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    server, client = to_flower("scaffold", fed3, **RUN)
    assert isinstance(server, ServerApp) and isinstance(client, ClientApp)


# --- the deployment runtime: flower-superlink + 3 flower-supernode + flwr run ------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_port(port: int, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _stop(procs: list[subprocess.Popen], ports: list[int]):
    """SIGTERM each process group, SIGKILL what is left after 20 s, then any straggler that names our ports."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
    for line in ps:
        pid, _, args = line.strip().partition(" ")
        if any(f"127.0.0.1:{port}" in args for port in ports) and int(pid) != os.getpid():
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.skipif(shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
                    reason="flower-superlink is not installed beside this Python")
def test_deployment_superlink_three_supernodes(tmp_path, fed3):
    bin_dir = str(Path(sys.executable).parent)
    link, *nodes = _free_ports(4)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "FLWR_HOME": str(tmp_path / "flwr"),
           "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    (tmp_path / "flwr").mkdir()
    (tmp_path / "flwr" / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{link}"\ninsecure = true\n')
    out, procs = tmp_path / "history.csv", []

    def start(name, *args):
        log = open(tmp_path / f"{name}.log", "w")
        procs.append(subprocess.Popen([os.path.join(bin_dir, args[0]), *args[1:]], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        start("superlink", "flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
              "--port", str(link))
        _wait_port(link, 60)
        for k, port in enumerate(nodes):
            start(f"supernode{k}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}",
                  "--port", str(port), "--node-config", f"partition-id={k} num-partitions=3")
        run = subprocess.run([os.path.join(bin_dir, "flwr"), "run", str(ROOT / "examples" / "flower_app"), "test",
                              "--stream", "--run-config", f"num-server-rounds=2 history-out='{out}'"],
                             env=env, capture_output=True, text=True, timeout=420)
        logs = run.stdout[-3000:] + run.stderr[-2000:]
        assert run.returncode == 0, logs
        assert out.exists(), f"the ServerApp did not save its History:\n{logs}"
    finally:
        _stop(procs, [link, *nodes])
    assert all(p.poll() is not None for p in procs)
    b = History.load(out)
    # the example app's defaults (pyproject.toml): SCAFFOLD, digits, logreg, 3 clients, all per round
    a = fl.simulate("scaffold", fed3, "logreg", rounds=2, clients_per_round=3, local_epochs=1, batch_size=32, lr=0.1,
                    seed=0, backend="loop", progress=False)
    assert list(b["round"]) == [1, 2]
    np.testing.assert_allclose(b[COLUMNS].to_numpy(float), a[COLUMNS].to_numpy(float), rtol=0, atol=TOL)
