"""Container tier: `docker compose -f compose/<file>.yml up` exactly as a user types it on a
machine that has none of the images, no `make` first. Compose must build what it needs and run
the job to one FINISHED run, and the job must print an address the user's browser can open.

The images get names no one has built (DDPLAB_*_IMAGE), so the build path runs even where
`make images` ran before; Docker's build cache keeps that fast after the first time. The
images are removed afterwards.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.helpers.containers import finished, sh, tags, wait_exits

pytestmark = pytest.mark.container


def _image_exists(name: str) -> bool:
    return sh(["docker", "image", "inspect", name], timeout=30).returncode == 0


@pytest.fixture
def fresh_images():
    prefix = f"ddplabfresh{uuid.uuid4().hex[:8]}"
    names = {"DDPLAB_CPU_IMAGE": f"{prefix}/cpu-oneccl:latest",
             "DDPLAB_MLFLOW_IMAGE": f"{prefix}/mlflow:latest",
             "DDPLAB_POSTGRES_IMAGE": f"{prefix}/postgres:latest",
             "DDPLAB_MPI_IMAGE": f"{prefix}/openmpi:latest",
             "DDPLAB_SLURM_IMAGE": f"{prefix}/slurm:latest"}
    yield names
    # This runs before compose_factory's `down`: stop what still uses the images first.
    for name in names.values():
        ids = sh(["docker", "ps", "-aq", "--filter", f"ancestor={name}"]).stdout.split()
        if ids:
            sh(["docker", "rm", "-f", *ids])
    left = [n for n in names.values() if _image_exists(n)]
    if left:
        sh(["docker", "rmi", *left], timeout=300)


# file -> (the service the job runs in, its launcher, the image built on the CPU one, the
# service that exits when the job is done and how many of it)
CASES = {"multinode.yml": ("node", "torchrun", "", "node", 2),
         "mpi.yml": ("worker", "openmpi", "DDPLAB_MPI_IMAGE", "launcher", 1),
         "slurm.yml": ("submit", "slurm", "DDPLAB_SLURM_IMAGE", "submit", 1)}


@pytest.mark.parametrize("file", list(CASES))
def test_compose_up_as_typed_builds_its_images_and_runs_the_job(compose_factory, fresh_images,
                                                                file):
    service, launcher, on_cpu, ends, count = CASES[file]
    assert not any(_image_exists(n) for n in fresh_images.values())
    c = compose_factory(2, 1, file=file, service=service, **fresh_images)
    c.up()
    # A cold machine builds torch's layer first (minutes); a warm build cache takes seconds.
    run = c.wait_run(finished, timeout=1800)
    assert run["info"]["status"] == "FINISHED", c.logs()[-4000:]
    t = tags(run)
    assert (t["ddplab.launcher"], t["ddplab.world_size"]) == (launcher, "2")
    assert len(t["ddplab.hosts"].split(",")) == 2 and len(c.runs()) == 1
    built = [n for n in fresh_images.values() if _image_exists(n)]
    # Every file includes tracking.yml: its PostgreSQL image is built too.
    expected = ["DDPLAB_CPU_IMAGE", "DDPLAB_MLFLOW_IMAGE", "DDPLAB_POSTGRES_IMAGE"]
    assert sorted(built) == sorted(fresh_images[k] for k in expected + ([on_cpu] if on_cpu else []))
    assert t["ddplab.image"] == fresh_images[on_cpu or "DDPLAB_CPU_IMAGE"]
    # The address printed is the browser's (the published port), never the in-network name.
    route = f"http://localhost:{c.port}/#/experiments/{run['info']['experiment_id']}/runs/"
    exited = wait_exits(c, ends, count, time.monotonic() + 120)
    assert exited and set(exited) == {0}
    logs = c.logs()
    assert route + run["info"]["run_id"] in logs and "http://mlflow:5000/#" not in logs
