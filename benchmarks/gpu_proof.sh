#!/usr/bin/env bash
# The GPU proof in one command, on a machine with its own PyTorch and no network:
#   bash benchmarks/gpu_proof.sh OUT [--device cuda|cpu] [--quick] [--kit DIR] [gpu_proof.py options]
# It installs the kit (`make gpu-kit`, built where PyPI is reachable: MLflow's client side and
# its SQL store) and ddplab itself (--no-deps: over the machine's own torch, which each run
# records) into a temporary site, then runs benchmarks/gpu_proof.py with an embedded MLflow
# store under OUT. Nothing outside OUT and the temporary site is written.
set -uo pipefail
# OUT and --kit are where the user stands (the shell's working directory), made absolute before
# the cd below: a relative OUT lands beside the user, never inside the checkout unless asked.
here=$PWD
absolute() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s' "$here/$1" ;; esac; }
out=${1:?usage: gpu_proof.sh OUT [--device cuda|cpu] [--quick] [--kit DIR]}
shift
out=$(absolute "$out")
kit=
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) [ $# -ge 2 ] || { echo "gpu_proof: --kit: got nothing; allowed: --kit DIR, the kit's folder" >&2; exit 2; }
           kit=$(absolute "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
# A bad OUT is one line now, not a traceback after minutes of installing.
if [ -e "$out" ] && [ ! -d "$out" ]; then
  echo "gpu_proof: OUT: got '$out': an existing file; allowed: a folder (new or existing) for the proof's logs, store and pages" >&2
  exit 2
fi
if ! made=$(mkdir -p -- "$out" 2>&1); then
  echo "gpu_proof: OUT: got '$out': cannot make it (${made##*: }); allowed: a folder that can be made and written" >&2
  exit 2
fi
cd "$(dirname "$0")/.." || exit 2
kit=${kit:-$PWD/.gpu-kit}
py=${PYTHON:-python3}
if ! ls "$kit"/*.whl >/dev/null 2>&1; then
  echo "gpu_proof: no wheels in $kit: run 'make gpu-kit' where PyPI is reachable, and bring $kit along" >&2
  exit 2
fi
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "gpu_proof: $py has no torch: the machine's own PyTorch is what the proof runs on (PYTHON=...)" >&2
  exit 2
fi
site=$(mktemp -d /tmp/ddplab-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
t0=$(date +%s)
pipi() { "$py" -m pip -q --disable-pip-version-check "$@"; }
# ddplab's own wheel first (setuptools from the kit builds it), then one install of the kit and
# that wheel, --no-deps: the kit is the whole list; pip must not reach for an index.
fail() { echo "gpu_proof: $1 failed (see above)" >&2; exit 2; }
pipi install --no-index --no-deps --target "$site/build" "$kit"/setuptools-*.whl || fail "installing setuptools"
mkdir -p "$site/src" && cp -r pyproject.toml README.md src "$site/src/"  # built there: the checkout stays clean
PYTHONPATH="$site/build" pipi wheel --no-index --no-deps --no-build-isolation -w "$site/wheel" "$site/src" \
  || fail "building ddplab's wheel"
pipi install --no-index --no-deps --no-compile --target "$site/lib" "$kit"/*.whl "$site"/wheel/ddplab-*.whl \
  || fail "installing the kit and ddplab into $site/lib"
export PYTHONPATH="$site/lib${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/lib/bin:$PATH"
echo "[proof] kit and ddplab installed in $(( $(date +%s) - t0 ))s: $("$py" -c 'import ddplab, mlflow, torch; print("ddplab", ddplab.__version__, "mlflow", mlflow.__version__, "torch", torch.__version__)')"
"$py" benchmarks/gpu_proof.py "$out" "${args[@]}"  # not exec: the trap removes the site
