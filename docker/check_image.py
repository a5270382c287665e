"""Build-time check: fail the image build when the image is not what its build args promise.

    python check_image.py --torch 2.7.1 --torchvision 0.22.1 --ipex 2.7.0 --oneccl 1
    python check_image.py --torch 2.7.1 --torchvision 0.22.1 --cuda
Writes /opt/ddplab/image.json with what was found (ddplab's capsule reads versions itself).
"""

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path


def fail(msg: str) -> None:
    sys.exit(f"IMAGE CHECK FAILED: {msg}")


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


p = argparse.ArgumentParser()
p.add_argument("--torch", required=True)
p.add_argument("--torchvision", required=True)
p.add_argument("--ipex", default="")
p.add_argument("--oneccl", choices=["0", "1", "auto"], default="0",
               help="1: the bindings must register ccl; 0: they must be absent; auto: either")
p.add_argument("--cuda", action="store_true", help="torch must be built with CUDA and NCCL")
p.add_argument("--ddplab-ccl", action="store_true",
               help="ddplab's own ccl backend must load (built by python -m ddplab.ccl.build)")
a = p.parse_args()

import torch  # noqa: E402 - after argument errors
import torch.distributed as dist  # noqa: E402

found = {"torch": torch.__version__, "torchvision": version("torchvision"),
         "ipex": version("intel-extension-for-pytorch"), "oneccl_bind_pt": version("oneccl-bind-pt"),
         "mlflow": version("mlflow"), "ddplab": version("ddplab"), "cuda": torch.version.cuda,
         "nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available()}
if torch.__version__.split("+")[0] != a.torch:
    fail(f"torch is {torch.__version__}, expected {a.torch}")
if found["torchvision"].split("+")[0] != a.torchvision:
    fail(f"torchvision is {found['torchvision']}, expected {a.torchvision}")
import torchvision  # noqa: E402,F401 - a torchvision built for another torch fails here

if not dist.is_gloo_available():
    fail("torch has no gloo backend")
if a.cuda and not (torch.version.cuda and dist.is_nccl_available()):
    fail(f"torch is not a CUDA build with NCCL (cuda={torch.version.cuda}, nccl={found['nccl']})")
if a.ipex:
    import intel_extension_for_pytorch as ipex  # noqa: E402

    if ipex.__version__.split("+")[0] != a.ipex:
        fail(f"IPEX is {ipex.__version__}, expected {a.ipex}")
if a.oneccl == "1" or (a.oneccl == "auto" and found["oneccl_bind_pt"] != "absent"):
    import oneccl_bindings_for_pytorch  # noqa: E402,F401

    if "ccl" not in dist.Backend.backend_list:
        fail("oneccl_bindings_for_pytorch imported but registered no 'ccl' backend")
elif a.oneccl == "0" and found["oneccl_bind_pt"] != "absent":
    fail("WITH_ONECCL=0 but oneccl_bind_pt is installed")
import ddplab.training.run  # noqa: E402,F401 - the package and its dependencies import

if a.ddplab_ccl:
    from ddplab import ccl  # noqa: E402

    module, why = ccl.load()
    if module is None:
        fail(why)
    found["ddplab_ccl"] = module.oneccl_version()

Path("/opt/ddplab").mkdir(parents=True, exist_ok=True)
Path("/opt/ddplab/image.json").write_text(json.dumps(found, indent=2))
print("image check ok:", json.dumps(found))
