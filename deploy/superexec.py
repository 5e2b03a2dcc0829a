"""A warm ClientApp executor for a SuperNode started with ``--isolation process``.

Run it instead of ``flower-superexec`` on each SuperNode's machine::

    flower-supernode --isolation process --port 9094 ... &
    python -m deploy.superexec --runtime-api-address 127.0.0.1:9094 --insecure &

The process you start (the zygote) imports the ``--preload`` modules once and forks:
one poller running Flower's SuperExec loop with a ``PipeExecutor``, and one
child per message running Flower's ``run_clientapp``. The app's own modules are
re-imported from the run's FAB in every child. Design, limits and measurements:
docs/deploy.md, "The warm executor".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import signal
import sys
import sysconfig
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from logging import DEBUG, ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log
from flwr.supercore.constant import TaskType
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult
from flwr.supernode.runtime.run_clientapp import run_clientapp  # imported before any fork

OWN_PACKAGE = Path(__file__).resolve().parent  # deploy/: kept when app modules are dropped
APP_DIR = OWN_PACKAGE.parent  # the checkout whose modules the children import from a FAB
# This app's ClientApp, and the third-party modules it imports only on first use: the
# optimizer's torch._dynamo (~1 s), the partitioners' flwr_datasets and datasets
# (~1 s), the vision tasks' torchvision (~0.5 s) and scikit-learn (~0.25 s).
DEFAULT_PRELOAD = (
    "client_app.app",
    "torch._dynamo",
    "flwr_datasets",
    "datasets",
    "torchvision",
    "sklearn.datasets",
    "sklearn.model_selection",
)
DEFAULT_POLL_INTERVAL = 0.2  # s between two AcquireTask calls (Flower's default: 1 s)
STOP_TIMEOUT = 10.0  # s from SIGTERM to SIGKILL for the poller and the children
TICK = 0.1  # s: the zygote's loop wakes this often to reap children
# A child's retries to pull the message's objects from the SuperNode: the first after
# 0.05 s, doubling up to 0.2 s between two (Flower's: 1 s, doubling up to 10 s, at most
# 500 tries); bounded by Flower's 2 h for the whole pull instead of a number of tries.
OBJECT_PULL_RETRY = {"initial_backoff": 0.05, "backoff_cap": 0.2, "max_tries_per_object": None}
POLL_INTERVAL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # read by Flower's run_superexec
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_torch_threads: int | None = None  # torch's default intra-op threads, restored in children
TORCH_FIXED_SEED = 67280421310721  # older torch seeds every new process's generator so
_torch_seed: int | None = None  # that fixed seed, if this torch does; None: drawn anew

# Python 3.12+ warns at every os.fork() of a process with other native threads. The
# zygote has some once numpy and pyarrow are imported: the BLAS worker pools and
# jemalloc's background thread, which shut down or re-initialise themselves around
# fork (pthread_atfork), as every forking DataLoader relies on. No Python thread runs.
warnings.filterwarnings("ignore", r".*use of fork\(\) may lead to deadlocks", DeprecationWarning)


# -- the zygote's preload -------------------------------------------------------------
def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


def installed_dirs() -> tuple[str, ...]:
    """Where this Python's packages are installed: its prefixes and site-packages. A
    virtual environment may lie inside the checkout (the README's ``.venv``, CI's
    ``.ci-venv``); what is installed there is no app module."""
    paths = sysconfig.get_paths()
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, paths["purelib"], paths["platlib"]}
    return tuple(sorted({os.path.realpath(d) for d in dirs if d}))


def app_modules(app_dir: Path = APP_DIR) -> list[str]:
    """Names of the loaded modules whose file (or package path) lies under ``app_dir``,
    except those of this package (``deploy``) and those installed in this Python's
    environment (``installed_dirs``), even where that lies under ``app_dir``."""
    root, own = str(Path(app_dir).resolve()), str(OWN_PACKAGE)
    installed = [d for d in installed_dirs() if not _under(root, d)]  # the app is not in it
    names = []
    for name, module in list(sys.modules.items()):
        paths = [getattr(module, "__file__", None)]
        with contextlib.suppress(TypeError):  # some modules' __path__ is no list
            paths += list(getattr(module, "__path__", None) or [])
        real = [os.path.realpath(p) for p in paths if isinstance(p, str)]
        inside = [p for p in real if _under(p, root)]
        if not inside or any(_under(p, own) for p in real):
            continue
        if any(_under(p, d) for p in inside for d in installed):
            continue
        names.append(name)
    return sorted(names)


def preload(modules: Iterable[str], app_dir: Path = APP_DIR) -> list[str]:
    """Import ``modules`` (and so everything they import), then forget the app's own
    modules (``app_modules``) so that each child imports them from its run's FAB.

    Returns
    -------
    list[str]
        The forgotten module names.
    """
    global _torch_threads, _torch_seed
    try:  # first, so that nothing imported after it can start an OpenMP team here
        import torch
    except ImportError:
        pass
    else:
        _torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        seed = torch.initial_seed()  # fixed in older torch, drawn per process in newer
        _torch_seed = seed if seed == TORCH_FIXED_SEED else None
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # the app missing here, or raising at import
            log(WARNING, "Preload of %s failed (%r): each ClientApp imports it itself", name, err)
    dropped = app_modules(app_dir)
    if "flwr" in dropped:  # forgetting the installed packages breaks every child
        raise SystemExit(
            f"deploy.superexec: Flower itself lies in the app directory {app_dir}, so the "
            "app's modules cannot be told from the installed packages; install the app "
            "editable (`pip install -e .`, as docs/deploy.md does)"
        )
    for name in dropped:
        del sys.modules[name]
    return dropped


def fork_hazards() -> list[str]:
    """What makes forking this process unsafe: Python threads besides the main one (a
    lock one of them holds stays held in the child), or an initialised CUDA (a forked
    child cannot use it)."""
    hazards = []
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        hazards.append(f"Python threads are running: {', '.join(others)}")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        hazards.append("CUDA is initialised (a forked child cannot use it)")
    if torch is not None and torch.get_num_threads() > 1:  # its OpenMP team would hang them
        hazards.append(f"torch runs {torch.get_num_threads()} intra-op threads, not 1")
    return hazards


# -- forking --------------------------------------------------------------------------
def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _exit_status(exc: SystemExit) -> int:
    """The process exit status ``sys.exit(code)`` would give."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def fork(body: Callable[[], Any]) -> int:
    """Fork a child that runs ``body()`` and exits (0, its ``sys.exit`` status, or 1 if
    it raised); return its pid. The child gets the default SIGTERM and SIGINT handlers;
    a stop signal that arrives during the fork is held until then, so none is lost."""
    _flush()  # or what is buffered is written twice
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return pid
    status = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        body()
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        os._exit(status)  # never back into the zygote's loop, nor its atexit handlers


def describe_exit(wait_status: int) -> tuple[int, str]:
    """(exit code, or -N for signal N; words) of a ``waitpid`` status."""
    code = os.waitstatus_to_exitcode(wait_status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return code, f"killed by {name}"
    return code, f"exited with status {code}"


def _as_fresh_process() -> None:
    """In a child: numpy's legacy global generator seeded from OS entropy, torch's CPU
    generator seeded as a new process seeds it (torch's fixed seed, or one from OS
    entropy), and torch's default thread count."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        if _torch_seed is not None:
            torch.default_generator.manual_seed(_torch_seed)
        else:
            torch.default_generator.seed()
        if _torch_threads is not None:
            torch.set_num_threads(_torch_threads)


# -- the zygote -----------------------------------------------------------------------
@dataclass
class ChildResult:
    """How one child ended."""

    task_id: int
    pid: int
    returncode: int  # -N: killed by signal N
    seconds: float


class Zygote:
    """Fork a child running ``run_task(task)`` for every task (a JSON line with at least
    ``token`` and ``task_id``) read from ``tasks_fd``; reap them; stop on SIGTERM/SIGINT,
    when the poller dies, or when ``parent_pid`` is gone.

    Parameters
    ----------
    tasks_fd : int
        Read end of the pipe the poller writes tasks into.
    run_task : Callable[[dict], Any]
        What a child runs (``run_clientapp_task``); it runs in the child only.
    poller_pid : int, optional
        The poller, a child of this process: when it exits, the zygote stops.
    parent_pid : int, optional
        Stop when this process is gone (``--parent-pid``).
    stop_timeout : float
        Seconds between SIGTERM and SIGKILL for the poller and the children.
    """

    def __init__(
        self,
        tasks_fd: int,
        run_task: Callable[[dict], Any],
        *,
        poller_pid: int | None = None,
        parent_pid: int | None = None,
        stop_timeout: float = STOP_TIMEOUT,
    ) -> None:
        self.tasks_fd = tasks_fd
        self.run_task = run_task
        self.poller_pid = poller_pid
        self.parent_pid = parent_pid
        self.stop_timeout = stop_timeout
        self.children: dict[int, tuple[int, float]] = {}  # pid -> (task id, started)
        self.results: deque[ChildResult] = deque(maxlen=1000)
        self.launched = 0
        self.stopping = False
        self.exit_code = 0
        self._buffer = b""

    def request_stop(self, signum: int, _frame: object = None) -> None:
        """Signal handler: stop at the next tick."""
        log(INFO, "Warm executor: %s received, stopping", signal.Signals(signum).name)
        self.stopping = True

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the zygote (and so its poller and children)."""
        for signum in _STOP_SIGNALS:
            signal.signal(signum, self.request_stop)

    def serve(self) -> int:
        """Run until stopped; then stop the poller and the children. Returns the exit
        code: 0 when stopped by a signal or by the parent's exit, 1 when the poller died."""
        self.install_signal_handlers()
        try:
            while not self.stopping:
                ready, _, _ = select.select([self.tasks_fd], [], [], TICK)
                if ready:
                    self._read_tasks()
                self.reap()
                if self.parent_pid is not None and not _alive(self.parent_pid):
                    log(INFO, "Warm executor: parent process %d is gone", self.parent_pid)
                    self.stopping = True
        finally:
            self.shutdown()
        return self.exit_code

    def _read_tasks(self) -> None:
        data = os.read(self.tasks_fd, 65536)
        if not data:  # every writer closed the pipe: the poller is gone
            self.reap()
            if not self.stopping:
                log(ERROR, "Warm executor: the poller closed its pipe; stopping")
                self.exit_code, self.stopping = 1, True
            return
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        for line in lines:
            try:
                task = json.loads(line)
                int(task["task_id"]), str(task["token"])
            except (ValueError, KeyError, TypeError):
                log(ERROR, "Warm executor: ignoring a malformed task line %r", line[:80])
                continue
            try:
                self.launch(task)
            except OSError as err:  # no fork (memory, process limit): the SuperNode
                # hands the task out again once its claim lapses (30 s)
                log(ERROR, "Warm executor: cannot fork for task %s: %s", task["task_id"], err)

    def launch(self, task: dict) -> int:
        """Fork the child for ``task``; return its pid."""
        started = time.monotonic()

        def body() -> None:
            os.close(self.tasks_fd)
            _as_fresh_process()
            self.run_task(task)

        pid = fork(body)
        self.children[pid] = (int(task["task_id"]), started)
        self.launched += 1
        log(DEBUG, "Warm executor: task %s -> ClientApp pid %d", task["task_id"], pid)
        return pid

    def reap(self) -> None:
        """Collect every child that has exited, and log how it ended."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # none left, whatever we thought
                self.children.clear()
                self.poller_pid = None
                return
            if pid == 0:
                return
            code, words = describe_exit(status)
            if pid == self.poller_pid:
                self.poller_pid = None
                if not self.stopping:
                    log(ERROR, "Warm executor: the poller (pid %d) %s; stopping", pid, words)
                    self.exit_code, self.stopping = 1, True
                continue
            if pid not in self.children:
                continue
            task_id, started = self.children.pop(pid)
            seconds = time.monotonic() - started
            self.results.append(ChildResult(task_id, pid, code, seconds))
            if code == 0:
                log(INFO, "Warm executor: task %d done in %.2f s (pid %d)", task_id, seconds, pid)
            elif code > 0:
                log(
                    WARNING,
                    "Warm executor: the ClientApp of task %d (pid %d) %s after %.2f s "
                    "(its error is logged above)",
                    task_id, pid, words, seconds,
                )  # fmt: skip
            else:
                log(
                    ERROR,
                    "Warm executor: the ClientApp of task %d (pid %d) was %s after %.2f s "
                    "without replying. The SuperNode fails the task when its heartbeat "
                    "lapses (up to 60 s) and replies 'ClientApp stopped responding.'",
                    task_id, pid, words, seconds,
                )  # fmt: skip

    def shutdown(self) -> None:
        """SIGTERM the poller and every child, SIGKILL what is left after
        ``stop_timeout`` seconds, and reap them all."""
        for signum in _STOP_SIGNALS:  # a second Ctrl-C must not interrupt the clean-up
            signal.signal(signum, signal.SIG_IGN)
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while self._running() and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        if self._running():
            log(WARNING, "Warm executor: SIGKILL for %s", self._running())
            self._signal_all(signal.SIGKILL)
            while self._running():
                self.reap()
                time.sleep(0.05)

    def _running(self) -> list[int]:
        return [*self.children, *([self.poller_pid] if self.poller_pid else [])]

    def _signal_all(self, signum: int) -> None:
        for pid in self._running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_clientapp_task(
    task: dict, *, runtime_api_address: str, insecure: bool, certificates: bytes | None
) -> None:
    """What a child runs: Flower's ``run_clientapp``, as ``flwr-clientapp --token`` does,
    watching the zygote (its parent) and without dependency installation.

    It retries pulling the message's objects sooner than Flower does
    (``OBJECT_PULL_RETRY``): a forked child asks for them milliseconds after the
    SuperNode made the task, often before the SuperNode has them from the SuperLink
    (0.6-1 s later here), and Flower's first retry after 1 s, the next after 2 s
    more, would add up to a second to every message. A new ``flwr-clientapp`` asks
    seconds later, when they are there."""
    defaults = pull_and_inflate_object_from_tree.__kwdefaults__
    if defaults is not None and set(OBJECT_PULL_RETRY) <= set(defaults):
        defaults.update(OBJECT_PULL_RETRY)
    run_clientapp(
        runtime_api_address=runtime_api_address,
        token=task["token"],
        insecure=insecure,
        certificates=certificates,
        parent_pid=os.getppid(),
        runtime_dependency_install=False,
    )


# -- the poller -----------------------------------------------------------------------
class PipeExecutor:
    """A Flower SuperExec executor (``flwr.supercore.superexec.executor.Executor``)
    that takes only ``flwr-clientapp`` tasks and launches each by writing its token and
    task id, one JSON line, into the zygote's pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def get_eligible_capacity(
        self,
        supported_task_types: set[TaskType],
        *,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> tuple[set[TaskType], set[str]]:
        """Only ClientApp tasks are acquired, without a capacity limit."""
        del insecure, root_certificates_path
        return set(supported_task_types) & {TaskType.CLIENT_APP}, set()

    def wait_for_capacity(self, *_args: object, **_kwargs: object) -> None:
        """No capacity gate."""

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        """Hand the task to the zygote."""
        if spec.task_type != TaskType.CLIENT_APP:
            return LaunchResult.failed(f"the warm executor runs no {spec.task_type} tasks")
        line = json.dumps({"token": spec.token, "task_id": spec.task_id}).encode() + b"\n"
        if len(line) > select.PIPE_BUF:  # a longer write could interleave
            return LaunchResult.failed("task token too long for the zygote's pipe")
        try:
            os.write(self.fd, line)
        except OSError as err:
            return LaunchResult.failed(f"the warm executor's zygote is gone ({err})")
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Nothing to maintain: the zygote reaps the children."""

    def close(self) -> None:
        """Close the pipe."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def run_poller(fd: int, args: argparse.Namespace, zygote_pid: int) -> None:
    """Flower's SuperExec loop (``run_superexec``) with a ``PipeExecutor``; runs in
    the poller process until it is stopped (or the zygote is gone)."""
    from flwr.supercore.auth import load_superexec_auth_secret
    from flwr.supercore.superexec import run_superexec as superexec
    from flwr.supercore.utils import disable_process_dumping

    disable_process_dumping(strict=False)  # as flower-superexec: it holds task tokens
    os.environ[POLL_INTERVAL_ENV] = str(args.poll_interval)
    executor = PipeExecutor(fd)
    if not hasattr(superexec, "get_executor"):
        raise RuntimeError("flwr.supercore.superexec.run_superexec has no get_executor")
    # run_superexec builds its executor by type (subprocess or Kubernetes) and takes no
    # executor object: hand it ours in the poller process.
    superexec.get_executor = lambda *_args, **_kwargs: executor
    superexec.run_superexec(
        runtime_api_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates_path=args.root_certificates,
        superexec_auth_secret=load_superexec_auth_secret(args.superexec_auth_secret_file),
        parent_pid=zygote_pid,
        runtime_dependency_install=False,
    )


# -- the command ----------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``python -m deploy.superexec`` options (``flower-superexec``'s, plus the preload)."""
    parser = argparse.ArgumentParser(
        prog="python -m deploy.superexec",
        description="Warm ClientApp executor for a SuperNode with --isolation process: "
        "one fork of a preloaded process per message instead of a new flwr-clientapp.",
    )
    address = parser.add_mutually_exclusive_group(required=True)
    address.add_argument(
        "--runtime-api-address", help="the SuperNode's Runtime API (its --host:--port)"
    )
    address.add_argument(
        "--appio-api-address", dest="runtime_api_address", help=argparse.SUPPRESS
    )  # Flower's old name, as flower-superexec still accepts it
    parser.add_argument(
        "--insecure", action="store_true", help="plain HTTP to the Runtime API (loopback)"
    )
    parser.add_argument(
        "--root-certificates", help="CA of the Runtime API's certificate (with TLS)"
    )
    parser.add_argument(
        "--superexec-auth-secret-file",
        help="the SuperNode's --superexec-auth-secret-file, if it has one",
    )
    parser.add_argument(
        "--parent-pid", type=int, help="stop when this process (e.g. the SuperNode) exits"
    )
    parser.add_argument(
        "--preload",
        nargs="*",
        default=list(DEFAULT_PRELOAD),
        metavar="MODULE",
        help="modules to import once before forking (default: %(default)s); modules "
        "of the app's directory are dropped again and imported from the FAB per message",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help="seconds between two task polls (default: %(default)s)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=STOP_TIMEOUT,
        help="seconds from SIGTERM to SIGKILL for the children (default: %(default)s)",
    )
    parser.add_argument(
        "--allow-runtime-dependency-installation", action="store_true", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.allow_runtime_dependency_installation:
        parser.error(
            "the warm executor runs ClientApps in this Python environment: no runtime "
            "dependency installation (use flower-superexec for that)"
        )
    if args.insecure and args.root_certificates:
        parser.error("--insecure and --root-certificates exclude each other")
    if not 0.01 <= args.poll_interval <= 60:
        parser.error("--poll-interval must be between 0.01 and 60 seconds")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Preload, check, fork the poller, serve."""
    args = parse_args(argv)
    certificates = None
    if args.root_certificates:
        try:
            certificates = Path(args.root_certificates).expanduser().read_bytes()
        except OSError as err:
            raise SystemExit(f"deploy.superexec: --root-certificates: {err}") from None
    started = time.monotonic()
    dropped = preload(args.preload)
    if hazards := fork_hazards():
        raise SystemExit("deploy.superexec: cannot fork ClientApps safely: " + "; ".join(hazards))
    read_fd, write_fd = os.pipe()
    zygote_pid = os.getpid()
    zygote = Zygote(
        read_fd,
        lambda task: run_clientapp_task(
            task,
            runtime_api_address=args.runtime_api_address,
            insecure=args.insecure,
            certificates=certificates,
        ),
        parent_pid=args.parent_pid,
        stop_timeout=args.stop_timeout,
    )
    zygote.install_signal_handlers()  # before the poller exists: a stop stops it too

    def poller() -> None:
        os.close(read_fd)
        run_poller(write_fd, args, zygote_pid)

    zygote.poller_pid = fork(poller)
    os.close(write_fd)
    log(
        INFO,
        "Warm executor ready in %.1f s: preloaded %s (%d app modules left to each "
        "run's FAB); polling %s every %.2f s (poller pid %d)",
        time.monotonic() - started, ", ".join(args.preload) or "nothing", len(dropped),
        args.runtime_api_address, args.poll_interval, zygote.poller_pid,
    )  # fmt: skip
    code = zygote.serve()
    log(INFO, "Warm executor stopped after %d ClientApps", zygote.launched)
    sys.exit(code)


if __name__ == "__main__":
    main()
