"""Shared test set-up: torch threads, Hypothesis profiles, the ``slow`` and ``e2e``
selections, the task identity Flower's messages read."""

import os

# One OpenMP/BLAS thread per test process, set before numpy, torch or sklearn load
# their thread pools: on 2 cores shared by 2 workers, a second thread only spin-waits
# (a 16-point t-SNE: 7 s of CPU with two OpenMP threads, 0.1 s with one). Numba too:
# UMAP's parallel functions start a pool of one thread per core, and a t-SNE after it
# in the process then spins for 6 s.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

torch.set_num_threads(1)  # the CI machine has 2 cores; keep tests predictable

# Hypothesis budgets, by HYPOTHESIS_PROFILE: "dev" (the default) for the inner loop,
# "ci" (.ci/run) bounded and derandomized so a CI run is repeatable, "thorough" for a
# deliberate search. Property tests set no max_examples of their own.
_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("dev", max_examples=25, **_COMMON)
settings.register_profile("ci", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Each end-to-end module test_<name> is a work unit of its own (group "e2e-<name>": its
# module-scoped runs are made once, on one worker), except those that share a session's
# fixture (tests/e2e/conftest.py), so that it is made once: flwr run, reproducibility
# and engine parity read the plain digits run, and they and the PPO runs make their
# `flwr run`s on the session's local SuperLink (one start-up, ~9 s of CPU); privacy
# runs and the Ray cluster read the runs on the two-node cluster. Small units let
# `--dist loadgroup` spread the long modules over both workers.
E2E_GROUPS = {
    "test_flwr_run": "e2e-superlink",
    "test_reproducibility": "e2e-superlink",
    "test_engine_parity": "e2e-superlink",
    "test_lunar_lander": "e2e-superlink",
    "test_privacy_runs": "e2e-privacy",
    "test_ray_cluster": "e2e-privacy",
}

# What the fast default (`pytest -m "not e2e and not slow"`) leaves to CI: whole-app
# runs made many times over (resume, the privacy mechanisms' runs, reproducibility),
# PPO training and the study tools' analyses of real runs, the process-forking tests
# of the warm executor, the sweeps over processes and Ray tasks. A node id prefix
# each; the e2e tests are apart (marker e2e).
SLOW = (
    "tests/server_app/test_resume.py::test_resumed_run_equals_uninterrupted_run",
    "tests/server_app/test_privacy_runs.py",
    "tests/server_app/test_reproducibility.py",
    "tests/server_app/test_secure_runs.py",
    "tests/server_app/test_dp_attack.py",
    "tests/client_app/test_task_state.py",
    "tests/lab/test_study.py::test_analysing_existing_runs_writes_every_file",
    "tests/lab/test_sweep.py::test_a_sweep_runs_",
    "tests/lab/test_comparison.py::test_analysing_existing_runs_writes_every_file",
    "tests/lab/test_lunar_one_planet.py",
    "tests/lab/test_lunar_outcomes.py",
    "tests/deploy/test_superexec.py::test_a_stop_signal_takes_the_poller_and_every_child_along",
    "tests/deploy/test_superexec.py::test_the_zygote_stops_when",
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(items):
    """Mark the ``SLOW`` tests ``slow``. Under ``pytest -n 2 --dist loadgroup`` (CI's
    command) the end-to-end tests go to the groups of ``E2E_GROUPS``, each run in order
    on one worker; the modules a worker runs share its local SuperLink
    (``tests/e2e/conftest.py``; each on its own port), and the deployment tests start
    their own SuperLink. Both cores are busy: what shortens the suite is less work, not
    more workers."""
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("e2e"):
            module = item.module.__name__.rsplit(".", 1)[-1]
            group = E2E_GROUPS.get(module, "e2e-" + module.removeprefix("test_"))
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def task_identity():
    """Message construction in flwr 1.41 reads the task identity the runtime sets:
    pretend to be task 1 of run 1 on node 0."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Each test starts at this process's one torch thread (set above), whatever an
    earlier test on the worker left: a run's floats depend on the thread count."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
