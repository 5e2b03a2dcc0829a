"""`python -m lab.connections ray-lab --ray-address HOST:PORT`: the connection it writes,
read back the way `flwr run` and the simulation runtime read it (no Ray, no SuperLink).

The end-to-end check on a two-node Ray cluster is ``tests/e2e/test_ray_cluster.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import time
import tomllib

import pytest
from flwr.simulation.app import _run_simulation_settings

from lab import connections
from lab.connections import LOCAL_SIMULATION, RAY_LAB, main

# `flwr federation simulation-config`'s module (its package re-exports the function
# under the module's name)
flower_command = importlib.import_module("flwr.cli.federation.simulation_config")


@pytest.fixture
def flwr_home(tmp_path, monkeypatch):
    """A private Flower home: the user's ~/.flwr is never written."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    return tmp_path


class _Stub:
    """The Control API client of ``flwr federation simulation-config``: records the
    requests it would send to the local SuperLink."""

    def __init__(self) -> None:
        self.requests: list = []

    def ConfigureSimulationFederation(self, request):
        self.requests.append(request)
        return type("Response", (), {"federation_name": ""})()


@pytest.fixture
def superlink(monkeypatch):
    """A running local SuperLink, as Flower's own command would reach it."""
    stub = _Stub()

    @contextlib.contextmanager
    def client(superlink, output_format):
        assert superlink in (LOCAL_SIMULATION, RAY_LAB, "lab-ray")
        yield stub, False

    monkeypatch.setattr(connections, "_is_local_superlink_started", lambda: True)
    monkeypatch.setattr(connections, "local_superlink_environments", lambda: {})
    monkeypatch.setattr(connections, "_start_local_superlink", lambda: None)
    monkeypatch.setattr(flower_command, "cli_output_control_client", client)
    return stub


def _superlinks(home) -> dict:
    return tomllib.loads((home / "config.toml").read_text())["superlink"]


def test_ray_connection_is_a_local_simulation_without_options(flwr_home, capsys, monkeypatch):
    # No local SuperLink runs on this machine (another test's may: this one must not see it).
    monkeypatch.setattr(connections, "_is_local_superlink_started", lambda: False)
    monkeypatch.setattr(connections, "local_superlink_environments", lambda: {})
    main(["--ray-address", "10.0.0.5:6379", "--num-supernodes", "7", "--num-cpus", "2",
          "--no-start"])  # fmt: skip
    entry = _superlinks(flwr_home)[RAY_LAB]  # the default name with --ray-address
    # Flower 1.42 deprecates per-connection options.*: the size goes to the SuperLink.
    assert entry == {"address": ":local:"}
    # Flower has no field for the address: it is nowhere in the file.
    assert "10.0.0.5" not in (flwr_home / "config.toml").read_text()
    out = capsys.readouterr().out
    assert "export RAY_ADDRESS=10.0.0.5:6379" in out
    assert f"flwr run . {RAY_LAB} --stream" in out
    # No SuperLink runs (--no-start): the size is said per run instead.
    assert 'num-supernodes=7 client-resources-num-cpus=2"' in out


def test_what_the_superlink_gets_gives_ray_init_no_resources(flwr_home, superlink, capsys):
    """The simulation config Flower's ``flwr federation simulation-config`` sends, as the
    simulation runtime turns it into the Ray backend config: the client resources
    arrive, and ray.init gets no num_cpus/num_gpus (it refuses them on a cluster)."""
    main(["lab-ray", "--ray-address", "head:6379", "--num-supernodes", "5", "--num-gpus", "0.5"])
    (request,) = superlink.requests
    assert request.federation_name == ""  # the local SuperLink's only federation
    sim_cfg = request.config
    assert not sim_cfg.HasField("init_args_num_cpus")
    assert not sim_cfg.HasField("init_args_num_gpus")
    num_supernodes, backend, config, _, _ = _run_simulation_settings(sim_cfg)
    assert (num_supernodes, backend) == (5, "ray")
    assert config["client_resources"] == {"num_cpus": 1, "num_gpus": 0.5}
    assert config["init_args"] == {}
    assert "5 SuperNodes, 1 CPU(s) and 0.5 GPU per ClientApp" in capsys.readouterr().out


def test_local_simulation_sets_ten_supernodes_of_one_cpu(flwr_home, superlink):
    main([])
    (request,) = superlink.requests
    assert request.config.num_supernodes == 10
    assert request.config.client_resources_num_cpus == 1
    assert request.config.backend == "ray"
    assert "options" not in _superlinks(flwr_home)[LOCAL_SIMULATION]


def test_other_connections_are_kept(flwr_home, capsys):
    main(["--no-start"])
    main(["--ray-address", "[fd00::5]:6379", "--no-start"])
    superlinks = _superlinks(flwr_home)
    assert {LOCAL_SIMULATION, RAY_LAB} <= set(superlinks)
    assert superlinks[LOCAL_SIMULATION] == {"address": ":local:"}
    assert "export RAY_ADDRESS=[fd00::5]:6379" in capsys.readouterr().out


@pytest.mark.parametrize(
    "address", ["ray://10.0.0.5:10001", "10.0.0.5", "10.0.0.5:port", "http://h:6379", "auto"]
)
def test_refuses_what_ray_init_would_not_join(flwr_home, address):
    with pytest.raises(SystemExit, match="--ray-address"):
        main(["--ray-address", address])
    assert not (flwr_home / "config.toml").exists()


def test_ray_address_and_a_real_superlink_exclude_each_other(flwr_home, capsys):
    with pytest.raises(SystemExit):
        main(["--ray-address", "head:6379", "--address", "superlink:9093", "--insecure"])
    assert "exclude each other" in capsys.readouterr().err


def test_warns_about_a_running_local_superlink_with_another_ray(flwr_home, monkeypatch):
    conn = connections.ray_cluster("head:6379")
    monkeypatch.setattr(connections, "local_superlink_ray_addresses", lambda: {4321: None})
    text = connections.ray_instructions(conn, "head:6379")
    assert "PID 4321" in text and "kill 4321" in text and "unset" in text
    monkeypatch.setattr(connections, "local_superlink_ray_addresses", lambda: {4321: "head:6379"})
    assert "Warning" not in connections.ray_instructions(conn, "head:6379")


def test_finds_the_local_superlink_of_this_home_and_its_ray_address(flwr_home):
    """A stand-in process whose command line names this home's local-superlink
    directory, like the SuperLink's --log-file, and whose environment has RAY_ADDRESS."""
    log_file = str(flwr_home / "local-superlink" / "superlink.log")
    env = {**os.environ, "RAY_ADDRESS": "head:6379"}
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", log_file]
    proc = subprocess.Popen(cmd, env=env)
    try:
        deadline = time.monotonic() + 10
        while (found := connections.local_superlink_ray_addresses()) == {}:
            assert time.monotonic() < deadline, "the stand-in process was not found"
            time.sleep(0.05)
        assert found == {proc.pid: "head:6379"}
    finally:
        proc.kill()
        proc.wait()


def test_lab_check_reads_the_size_from_the_running_superlink(flwr_home, monkeypatch):
    """The size lives in the running SuperLink only: read back as `flwr federation ls
    --federation` reads it (ShowFederation), None where it gives none."""
    import flwr.cli.utils
    from flwr.proto.control_pb2 import ShowFederationResponse
    from flwr.proto.federation_config_pb2 import SimulationConfig

    response = ShowFederationResponse()
    response.federation.simulation = True
    response.federation.config.CopyFrom(SimulationConfig(num_supernodes=7))
    asked = []

    class Client:
        def ShowFederation(self, request):
            asked.append(request.federation_name)
            return response

        def close(self):
            pass

    monkeypatch.setattr(flwr.cli.utils, "init_http_client_from_connection", lambda c: Client())
    monkeypatch.setattr(connections, "_is_local_superlink_started", lambda: True)
    assert connections.running_simulation_size() == 7
    assert asked == ["@none/default"]
    response.federation.simulation = False  # a deployment SuperLink: no simulation size
    assert connections.running_simulation_size() is None
    monkeypatch.setattr(connections, "_is_local_superlink_started", lambda: False)
    assert connections.running_simulation_size() is None
