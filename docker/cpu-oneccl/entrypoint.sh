#!/bin/sh
# ddplab CPU image entrypoint: load oneCCL's runtime environment when the bindings are
# installed, set oneCCL defaults the user has not set, then run the command unchanged.
set -e

# A function gets its own (empty) positional parameters, so setvars.sh cannot see ours.
load_oneccl_env() {
  # Looked up before importing it: importing torch costs every container's start ~1 s of CPU.
  python -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("oneccl_bindings_for_pytorch"))' \
    2>/dev/null || return 0
  if ccl_dir=$(python -c 'import torch, oneccl_bindings_for_pytorch as m; print(m.cwd)' 2>/dev/null) \
     && [ -f "$ccl_dir/env/setvars.sh" ]; then
    # shellcheck disable=SC1091
    . "$ccl_dir/env/setvars.sh" >/dev/null 2>&1 \
      || echo "entrypoint: warning: $ccl_dir/env/setvars.sh failed; ddplab sets the libfabric paths itself" >&2
  fi
}
load_oneccl_env

export CCL_ATL_TRANSPORT="${CCL_ATL_TRANSPORT:-ofi}"
export CCL_WORKER_COUNT="${CCL_WORKER_COUNT:-1}"
export CCL_ATL_SHM="${CCL_ATL_SHM:-1}"
# As the container's first process, or the first under its init (`docker run --init`, as
# `make run-cpu-oneccl` runs it: tini is PID 1 and ends the container when its child ends),
# the command runs under ddplab.launchers.outlive: when it ends, what it left running (this
# node's tracking delivery, recording the run's end after a rank was killed) still finishes
# instead of being killed with the container.
if [ "$$" = 1 ] || [ "$PPID" = 1 ]; then
  exec python -m ddplab.launchers.outlive "$@"
fi
exec "$@"
