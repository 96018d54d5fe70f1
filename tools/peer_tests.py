"""vLLM's own KV-cache and scheduler tests, from each supported line's source distribution.

``make engines`` fetches them (:func:`fetch`): the line's sdist from PyPI, its SHA-256
checked against PyPI's record, and only the files of :data:`FILES` unpacked into
``.engines/peer-vllm-<version>/`` (with a stamp, so a second run does nothing). The engine
suites run them on kvshare's pools (``tests/engines/vllm/test_peer_suite.py``).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import urllib.request
from pathlib import Path

from kvshare.api.engines import SupportedLine

#: The files taken from the sdist, relative to its ``tests/``: the KV cache manager's,
#: the block pool's and the scheduler's tests (preemption included), and what they import.
FILES = (
    "__init__.py",
    "v1/__init__.py",
    "v1/core/__init__.py",
    "v1/core/utils.py",
    "v1/core/test_prefix_caching.py",
    "v1/core/test_single_type_kv_cache_manager.py",
    "v1/core/test_priority_preemption_bug.py",
    "v1/core/test_scheduler.py",
    "v1/kv_connector/__init__.py",
    "v1/kv_connector/unit/__init__.py",
    "v1/kv_connector/unit/utils.py",
)
STAMP = ".kvshare-stamp"


class PeerTestsError(RuntimeError):
    """A line's tests could not be fetched (not on PyPI, a digest that differs)."""


_INDEX = "https://pypi.org/simple/{name}/"
_JSON = "application/vnd.pypi.simple.v1+json"


def directory(engines: Path, line: SupportedLine) -> Path:
    """Where ``line``'s tests are unpacked: its root holds ``tests/``."""
    return engines / f"peer-{line.environment}"


def is_fetched(engines: Path, line: SupportedLine) -> bool:
    """Whether ``line``'s tests are unpacked and current."""
    stamp = directory(engines, line) / STAMP
    return stamp.is_file() and stamp.read_text(encoding="utf-8").strip() == _stamp(line)


def _stamp(line: SupportedLine) -> str:
    return hashlib.sha256("\n".join((line.tested, *FILES)).encode()).hexdigest()


def _sdist(name: str, version: str) -> tuple[str, str]:
    """The URL and SHA-256 of ``name==version``'s source distribution, from PyPI's simple
    index (its JSON form, PEP 691)."""
    request = urllib.request.Request(_INDEX.format(name=name), headers={"Accept": _JSON})
    with urllib.request.urlopen(request, timeout=60) as page:
        index = json.load(page)
    wanted = f"{name}-{version}.tar.gz"
    for artifact in index["files"]:
        if artifact["filename"] == wanted:
            return artifact["url"], artifact["hashes"]["sha256"]
    raise PeerTestsError(f"PyPI has no source distribution {wanted}")


def fetch(engines: Path, line: SupportedLine) -> bool:
    """Unpack ``line``'s tests unless they are current; whether anything was fetched.
    Raises :class:`PeerTestsError`, :class:`OSError` (the network) or
    :class:`tarfile.TarError`."""
    if is_fetched(engines, line):
        return False
    url, sha256 = _sdist(line.engine, line.tested)
    with urllib.request.urlopen(url, timeout=600) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise PeerTestsError(f"{url}: SHA-256 differs from PyPI's record")
    target = directory(engines, line)
    staging = target.with_name(f".staging-{target.name}")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        prefix = f"{line.engine}-{line.tested}/tests/"
        for relative in FILES:
            try:
                member = archive.getmember(prefix + relative)
            except KeyError:
                continue  # not every line has every file (older lines lack some)
            source = archive.extractfile(member)
            assert source is not None
            path = staging / "tests" / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(source.read())
    (staging / STAMP).write_text(_stamp(line) + "\n", encoding="utf-8")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return True
