"""The warm ClientApp executor (`python -m deploy.superexec`) without a deployment.

The zygote is tested in a subprocess of its own (:data:`DRIVER`): a pytest worker runs
threads, and forking it would be the hazard the zygote avoids. The driver preloads,
forks a stand-in poller that passes the test's task lines (from stdin) into the
zygote's pipe, and serves; each child runs :data:`DRIVER`'s ``run_task`` instead of
Flower's ``run_clientapp``. ``tests/e2e/test_deployment.py`` runs the real thing
against SuperNodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResultStatus

from deploy import superexec

REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from dataclasses import asdict
    from pathlib import Path

    from deploy import superexec

    out, parent, preload = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    if "torch" not in preload:  # a zygote without torch, as where it is not installed
        sys.modules["torch"] = None  # (its import is ~3 s of CPU a driver)
    sys.path.insert(0, str(out / "app"))

    def write(marker, record):  # whole or not at all: the test polls for the file
        part = marker.with_suffix(".part")
        part.write_text(json.dumps(record))
        part.replace(marker)

    def run_task(task):
        action, marker = task["action"], out / f"{task['task_id']}.json"
        if action == "ok":
            import numpy, torch
            a = torch.ones(512, 512)
            write(marker, {
                "pid": os.getpid(), "ppid": os.getppid(),
                "numpy": float(numpy.random.random()),
                "torch": torch.rand(2).tolist(),
                "threads": torch.get_num_threads(),
                "matmul": float((a @ a).sum()),  # a parallel op: its own pool, no hang
                "fakeapp": "fakeapp" in sys.modules,
            })
        elif action == "raise":
            raise RuntimeError("boom")
        elif action == "exit3":
            sys.exit(3)
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action in ("sleep", "ignore-term"):
            if action == "ignore-term":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            write(marker, {"pid": os.getpid()})
            time.sleep(3600)

    dropped = superexec.preload(preload, app_dir=out / "app")
    hazards = superexec.fork_hazards()
    read_fd, write_fd = os.pipe()

    def poller():  # what run_poller does with tokens, with the test's lines
        os.close(read_fd)
        for line in sys.stdin:
            os.write(write_fd, line.encode())
        time.sleep(3600)

    zygote = superexec.Zygote(
        read_fd, run_task, parent_pid=parent if parent > 0 else None, stop_timeout=1
    )
    zygote.install_signal_handlers()
    zygote.poller_pid = superexec.fork(poller)
    os.close(write_fd)
    print(json.dumps({
        "dropped": dropped, "hazards": hazards, "poller": zygote.poller_pid,
        "threads": superexec._torch_threads, "seed": superexec._torch_seed,
    }), flush=True)
    code = zygote.serve()
    print(json.dumps([asdict(r) for r in zygote.results]), flush=True)
    sys.exit(code)
    """
)


class Driver:
    """The zygote of :data:`DRIVER` in a subprocess, fed task lines on stdin."""

    def __init__(self, tmp: Path, *preload: str, parent: int = 0) -> None:
        self.out = tmp
        app = tmp / "app" / "fakeapp"
        app.mkdir(parents=True)
        (app / "__init__.py").write_text("import json\n")
        (app / "mod.py").write_text("VALUE = 1\n")
        self.log = tmp / "zygote.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", DRIVER, str(tmp), str(parent), *preload],
                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, start_new_session=True,
            )  # fmt: skip
        self.ready = json.loads(self.proc.stdout.readline() or "null")
        assert self.ready, self.log.read_text()

    def send(self, task_id: int, action: str) -> None:
        self.proc.stdin.write(json.dumps({"task_id": task_id, "token": "t", "action": action}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def wait_for(self, condition, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"{what}\n{self.log.read_text()}"
            time.sleep(0.05)

    def marker(self, task_id: int) -> dict:
        return json.loads((self.out / f"{task_id}.json").read_text())

    def finish(self, timeout: float = 30) -> tuple[int, dict[int, int], str]:
        """Exit code, task id -> child return code, log."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"zygote still running\n{self.log.read_text()}") from None
        results = json.loads(self.proc.stdout.readline() or "[]")
        return (
            self.proc.returncode,
            {r["task_id"]: r["returncode"] for r in results},
            self.log.read_text(),
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def driver(tmp_path):
    drivers: list[Driver] = []

    def start(*preload: str, parent: int = 0) -> Driver:
        drivers.append(Driver(tmp_path, *preload, parent=parent))
        return drivers[-1]

    yield start
    for d in drivers:
        d.kill()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_children_start_as_fresh_processes_and_crashes_are_reported(driver):
    zygote = driver("numpy", "torch", "fakeapp.mod")
    # The app's own modules are forgotten after the preload; third-party ones stay.
    assert zygote.ready["dropped"] == ["fakeapp", "fakeapp.mod"]
    assert zygote.ready["hazards"] == []
    actions = {1: "ok", 2: "raise", 3: "exit3", 4: "kill", 5: "ok", 6: "ok"}
    for task_id, action in actions.items():
        zygote.send(task_id, action)
    zygote.wait_for(
        lambda: zygote.log.read_text().count("Warm executor: ") >= len(actions),
        "not every child was reaped",
    )
    zygote.proc.send_signal(signal.SIGTERM)
    code, results, log = zygote.finish()
    assert code == 0, log
    assert results == {1: 0, 2: 1, 3: 3, 4: -signal.SIGKILL, 5: 0, 6: 0}, log
    assert "RuntimeError: boom" in log  # a child's traceback reaches the zygote's log
    assert "task 4 (pid" in log and "was killed by SIGKILL" in log
    assert "task 3 (pid" in log and "exited with status 3" in log
    ok = [zygote.marker(t) for t in (1, 5, 6)]
    assert {m["ppid"] for m in ok} == {zygote.proc.pid}
    assert len({m["pid"] for m in ok}) == 3  # one process per message
    assert len({m["numpy"] for m in ok}) == 3  # numpy's global generator reseeded
    if zygote.ready["seed"] is None:  # this torch seeds each new process anew
        assert len({tuple(m["torch"]) for m in ok}) == 3
    else:  # older torch: every new process starts from the same fixed seed
        fixed = torch.rand(2, generator=torch.Generator().manual_seed(zygote.ready["seed"]))
        assert all(m["torch"] == pytest.approx(fixed.tolist()) for m in ok)
    assert all(m["threads"] == zygote.ready["threads"] for m in ok)  # torch's default again
    assert all(m["matmul"] == 512.0**3 for m in ok)
    assert not any(m["fakeapp"] for m in ok)  # a child imports the app afresh


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_takes_the_poller_and_every_child_along(driver, signum):
    zygote = driver()
    zygote.send(1, "sleep")
    zygote.send(2, "ignore-term")  # needs the SIGKILL after stop_timeout (1 s)
    zygote.wait_for(lambda: all((zygote.out / f"{t}.json").exists() for t in (1, 2)), "no child")
    children = [zygote.marker(t)["pid"] for t in (1, 2)]
    started = time.monotonic()
    zygote.proc.send_signal(signum)
    code, results, log = zygote.finish(timeout=15)
    assert time.monotonic() - started < 10
    assert code == 0, log
    assert results == {1: -signal.SIGTERM, 2: -signal.SIGKILL}, log
    assert all(_gone(pid) for pid in [*children, zygote.ready["poller"]])


def test_the_zygote_stops_when_its_poller_dies(driver):
    zygote = driver()
    zygote.send(1, "sleep")
    zygote.wait_for(lambda: (zygote.out / "1.json").exists(), "no child")
    os.kill(zygote.ready["poller"], signal.SIGKILL)
    code, results, log = zygote.finish()
    assert code == 1, log
    assert "poller" in log and "stopping" in log
    assert results == {1: -signal.SIGTERM}
    assert _gone(zygote.marker(1)["pid"])


def test_the_zygote_stops_when_its_parent_is_gone(driver):
    parent = subprocess.Popen(["sleep", "600"])
    try:
        zygote = driver(parent=parent.pid)
        zygote.send(1, "sleep")
        zygote.wait_for(lambda: (zygote.out / "1.json").exists(), "no child")
    finally:
        parent.kill()
        parent.wait()
    code, results, log = zygote.finish()
    assert code == 0, log
    assert f"parent process {parent.pid} is gone" in log
    assert results == {1: -signal.SIGTERM}


def test_app_modules_are_those_under_the_app_directory_except_deploy(tmp_path, monkeypatch):
    package = tmp_path / "someapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "part.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import someapp.part  # noqa: F401

    try:
        assert superexec.app_modules(tmp_path) == ["someapp", "someapp.part"]
        in_checkout = superexec.app_modules(superexec.APP_DIR)
        assert __name__ in in_checkout  # tests/ lies in the checkout
        assert not any(name == "deploy" or name.startswith("deploy.") for name in in_checkout)
        assert "numpy" not in in_checkout and "flwr" not in in_checkout  # installed
    finally:
        for name in ("someapp", "someapp.part"):
            sys.modules.pop(name, None)


def test_installed_packages_are_no_app_modules_even_in_a_venv_inside_the_app(
    tmp_path, monkeypatch
):
    """The README's ``.venv`` and CI's ``.ci-venv`` lie inside the checkout: the packages
    installed there stay preloaded (forgetting them made every child re-import numpy,
    which fails, so no message was ever answered)."""
    site = tmp_path / ".venv" / "lib" / "site-packages"
    for package in (tmp_path / "someapp", site / "somelib"):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    import someapp  # noqa: F401
    import somelib  # noqa: F401

    try:
        assert superexec.app_modules(tmp_path) == ["someapp"]
    finally:
        for name in ("someapp", "somelib"):
            sys.modules.pop(name, None)


def test_the_zygote_refuses_an_app_directory_that_holds_flower(monkeypatch):
    """A non-editable install puts the app beside Flower in site-packages: refused with
    what to do, instead of forgetting every installed package."""
    flwr_dir = Path(sys.modules["flwr"].__file__).resolve().parent.parent
    monkeypatch.setattr(superexec, "installed_dirs", lambda: ())
    for name in ("_torch_threads", "_torch_seed"):  # preload sets them, and one thread
        monkeypatch.setattr(superexec, name, getattr(superexec, name))
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit, match="editable"):
            superexec.preload([], app_dir=flwr_dir)
    finally:
        torch.set_num_threads(threads)
    assert "flwr" in sys.modules and "numpy" in sys.modules  # nothing was forgotten


def test_a_python_thread_is_a_fork_hazard():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="holds-a-lock-maybe")
    thread.start()
    try:
        assert any("holds-a-lock-maybe" in hazard for hazard in superexec.fork_hazards())
    finally:
        stop.set()
        thread.join()


def _spec(task_type: TaskType, token: str = "secret-token") -> ExecutionSpec:
    return ExecutionSpec(
        task_type=task_type, runtime_api_address="127.0.0.1:9094", token=token,
        insecure=True, root_certificates_path=None, runtime_dependency_install=False,
        parent_pid=None, suppress_output=False, task_id=7,
    )  # fmt: skip


def test_the_pipe_executor_hands_only_clientapp_tasks_to_the_zygote():
    read_fd, write_fd = os.pipe()
    executor = superexec.PipeExecutor(write_fd)
    try:
        types, fabs = executor.get_eligible_capacity(set(TaskType))
        assert (types, fabs) == ({TaskType.CLIENT_APP}, set())
        assert executor.launch(_spec(TaskType.CLIENT_APP)).status == LaunchResultStatus.ACCEPTED
        assert json.loads(os.read(read_fd, 4096)) == {"token": "secret-token", "task_id": 7}
        refused = executor.launch(_spec(TaskType.SERVER_APP))
        assert refused.status == LaunchResultStatus.FAILED
        too_long = executor.launch(_spec(TaskType.CLIENT_APP, token="x" * 5000))
        assert too_long.status == LaunchResultStatus.FAILED
        os.close(read_fd)  # the zygote is gone
        gone = executor.launch(_spec(TaskType.CLIENT_APP))
        assert gone.status == LaunchResultStatus.FAILED and "zygote" in gone.message
    finally:
        executor.close()


def test_the_command_line_is_flower_superexecs_without_dependency_installation():
    args = superexec.parse_args(["--appio-api-address", "127.0.0.1:9094", "--insecure"])
    assert args.runtime_api_address == "127.0.0.1:9094" and args.insecure
    assert args.preload == list(superexec.DEFAULT_PRELOAD)
    with pytest.raises(SystemExit):
        superexec.parse_args(
            ["--runtime-api-address", "127.0.0.1:9094", "--allow-runtime-dependency-installation"]
        )
    with pytest.raises(SystemExit):
        superexec.parse_args(
            ["--runtime-api-address", "a:1", "--insecure", "--root-certificates", "ca.crt"]
        )


def test_exit_statuses_are_described():
    assert superexec.describe_exit(3 << 8) == (3, "exited with status 3")
    assert superexec.describe_exit(signal.SIGKILL) == (-9, "killed by SIGKILL")
