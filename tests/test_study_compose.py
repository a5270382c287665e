"""Container tier: a study whose variants are one-host clusters (compose/multinode.yml with
torchrun, compose/mpi.yml with Open MPI) beside a plain torchrun variant, all nested under one
parent in a real `mlflow server` on this host that the containers reach."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.helpers import Server, cli

pytestmark = pytest.mark.container


def test_ch11_nodes_runs_its_compose_variants_into_one_study(tmp_path):
    server = Server(tmp_path, host="0.0.0.0")
    server.start()
    try:
        out = cli(["study", "run", str(REPO / "experiments" / "studies" / "ch11-nodes.yaml"),
                   "--repeats", "1", "--set", "data.train_samples=512", "--set",
                   "data.eval_samples=256"], tmp_path, server.uri, timeout=1500)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        c = server.client()
        found = c.search_runs([e.experiment_id for e in c.search_experiments()])
        parents = [r for r in found if r.data.tags.get("ddplab.study_role") == "parent"]
        jobs = {r.data.tags["ddplab.variant"]: r for r in found
                if r.data.tags.get("ddplab.study_role") == "job"}
        assert len(parents) == 1 and set(jobs) == {"1node", "2nodes-torchrun", "2nodes-mpirun"}
        for name, launcher, nnodes in (("1node", "torchrun", "1"), ("2nodes-torchrun", "torchrun", "2"),
                                       ("2nodes-mpirun", "openmpi", "2")):
            t = jobs[name].data.tags
            assert jobs[name].info.status == "FINISHED", (name, t.get("ddplab.error"))
            assert (t["ddplab.launcher"], t["ddplab.nnodes"], t["ddplab.world_size"]) == (
                launcher, nnodes, "2")
            assert len(t["ddplab.hosts"].split(",")) == int(nnodes)
            assert "perf/samples_per_s" in jobs[name].data.metrics
        assert "2nodes-mpirun" in out.stdout and "openmpi" in out.stdout  # the report's table
    finally:
        server.kill()
