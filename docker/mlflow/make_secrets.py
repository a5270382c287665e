#!/usr/bin/env python3
"""Generate the team tracking server's secrets: the admin's login, the UI's form-signing key,
the database password. Standard library only (it runs in the server image and on the host).

    make_secrets.py DIR            write each missing one into DIR as a file (mode 0400);
                                   compose/tracking.yml's `tracking-secrets` runs this first
    make_secrets.py --k8s [NS]     print them as the Kubernetes Secrets k8s/ reads:
                                   `make k8s-secrets` pipes this into `kubectl create -f -`

Existing files are kept: the admin exists in the database from the first start, and a new
password in the file would no longer match it (change it with MLflow's update-password API, then
in the file).
"""

import base64
import json
import os
import secrets
import sys
from pathlib import Path

ADMIN = "admin"


def generated() -> dict[str, str]:
    return {"admin-username": ADMIN, "admin-password": secrets.token_urlsafe(24),
            "flask-secret-key": secrets.token_hex(32), "postgres-password": secrets.token_urlsafe(24)}


def write_missing(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    made = []
    for name, value in generated().items():
        f = d / name
        if f.exists():
            continue
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as out:
            out.write(value + "\n")
        made.append(name)
    print(f"tracking secrets in {d}: " + (f"made {', '.join(made)}" if made else "kept (all present)"))
    # Each compose file is its own project (ddplab, ddplab-mpi, ...): the one this runs in.
    project = os.environ.get("DDPLAB_COMPOSE_PROJECT", "")
    where = f"-p {project}" if project else "-f compose/<the file you ran>.yml"
    print(f"MLflow login: user {(d / 'admin-username').read_text().strip()}, password: "
          f"docker compose {where} exec mlflow cat {d}/admin-password")


def secret(name: str, namespace: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/part-of": "ddplab"}},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def k8s_manifests(namespace: str) -> str:
    """Two Secrets, as JSON documents kubectl reads: the server's (mlflow-server) and the jobs'
    login (mlflow-credentials: the admin's, until you make each person a user)."""
    s = generated()
    keys = ("admin-password", "flask-secret-key", "postgres-password")
    server = secret("mlflow-server", namespace, {k: s[k] for k in keys})
    jobs = secret("mlflow-credentials", namespace,
                  {"username": s["admin-username"], "password": s["admin-password"]})
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [server, jobs]}, indent=2)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--k8s"]:
        print(k8s_manifests(argv[1] if len(argv) > 1 else "ddplab"))
    elif len(argv) == 1 and not argv[0].startswith("-"):
        write_missing(Path(argv[0]))
    else:
        sys.exit("usage: make_secrets.py DIR | make_secrets.py --k8s [NAMESPACE]")


if __name__ == "__main__":
    main(sys.argv[1:])
