"""A simulation whose ClientApps run on a Ray cluster of two nodes (docs/index.md, "Run
the simulation on a Ray cluster").

The cluster is started as a user starts one on two machines, here on one host
(``tests/e2e/ray_cluster.py``): `ray start --head` with 1 CPU, then `ray start --address
127.0.0.1:PORT` with 1 CPU. The run is the suite's SecAgg+ `flwr run`
(``tests/e2e/conftest.py``, :func:`cluster_run`; its privacy checks are in
``tests/e2e/test_privacy_runs.py``), through `lab.launcher.LocalSimulation(ray_address=...)`:
the connection from `lab.connections --ray-address` and `RAY_ADDRESS` for the local
SuperLink.

It passes only if Ray's own record of the tasks, the GCS's task events, holds a finished
`ClientAppActor.run` (Flower's ClientApp call) on each of the two nodes.

The same SuperLink makes the suite's `flwr run` of a run that fails its first start-up
check (Flower's status, the exit code): Flower starts the simulation's Ray beside the
ServerApp whatever the ServerApp does, which on the cluster is a join, not a start.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import SECAGG_ROUNDS

pytestmark = pytest.mark.e2e


def test_clientapps_run_on_both_nodes_of_a_ray_cluster(cluster_run):
    result = cluster_run.run
    assert result.returncode == 0, result.output
    assert result.status == "finished:completed", result.output
    assert f"Run completed after round {SECAGG_ROUNDS}" in result.output
    assert result.run_dir is not None and (result.run_dir / "metrics.csv").exists()
    assert "init-args" not in cluster_run.config  # ray.init refuses num_cpus when it joins

    calls, head, worker = cluster_run.calls, cluster_run.head, cluster_run.worker
    assert set(calls) <= {head, worker}, calls
    assert calls.get(head, 0) > 0 and calls.get(worker, 0) > 0, (calls, head, worker)


def test_a_run_that_cannot_learn_fails_loudly(cluster_run):
    # 5 nodes needed, the federation has 4: a start-up check stops the run before round 1
    # (and before any ClientApp is asked anything); outcome.json, Flower's status and the
    # launcher agree.
    result = cluster_run.failed
    assert result.returncode == 1 and result.status == "finished:failed", result.output
    (run_dir,) = list(cluster_run.failed_dir.iterdir())
    outcome = json.loads((run_dir / "outcome.json").read_text())
    assert outcome["status"] == "failed" and outcome["last-round"] == 0
    assert "'min-available-nodes' = 5 needs at least 5 nodes" in outcome["reason"]
    assert "the simulation has 4" in outcome["reason"]
    assert "Run failed after round 0: start-up check" in result.output
    assert (
        not (run_dir / "metrics.csv").exists()
        or "train" not in (run_dir / "metrics.csv").read_text()
    )
