"""The environment probe: what a Python environment holds, as that interpreter sees it.

Runs either in this process (when the target is the running interpreter) or as the source of
``python -c`` in the target interpreter (any Python >= 3.8, where hatch-vllm-patch may not be
installed). So: standard library only, no import of this package, and no import of vLLM:
top-level packages are found with ``importlib.util.find_spec`` (which does not import a
top-level package) and distributions with ``importlib.metadata``.

Answer (JSON): ``executable``, ``prefix``, ``base_prefix``, ``python_version``, ``purelib``,
``pycache_prefix``, ``distributions`` {name: {name, version, editable, location} | null} and
``modules`` {module: {file, package_dir, record_sha256}}.
"""

from __future__ import annotations

import base64
import importlib.metadata as md
import importlib.util
import json
import os
import sys
import sysconfig
from typing import Any


def _distribution(name: str) -> tuple[Any, dict[str, Any] | None]:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None, None
    editable = False
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        editable = bool(direct.get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        pass
    location = getattr(dist, "_path", None)
    return dist, {"name": dist.metadata["Name"], "version": dist.version, "editable": editable,
                  "location": str(location) if location else None}


def _record_sha256(files: list[Any], relative_path: str, real: str) -> str | None:
    for f in files:
        if f.hash is None or f.hash.mode != "sha256" or not str(f).endswith(relative_path):
            continue
        if os.path.realpath(str(f.locate())) == real:
            raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            return raw.hex()
    return None


def answer(queries: list[dict[str, str]]) -> dict[str, Any]:
    """The probe's answer for ``queries`` ([{distribution, module, relative_path}])."""
    out: dict[str, Any] = {
        "executable": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
        "python_version": ".".join(str(n) for n in sys.version_info[:3]),
        "purelib": sysconfig.get_paths()["purelib"],
        "pycache_prefix": getattr(sys, "pycache_prefix", None),
        "distributions": {}, "modules": {},
    }
    dists: dict[str, Any] = {}
    files: dict[str, list[Any]] = {}
    owners: dict[str, list[str]] | None = None
    for q in queries:
        name = q["distribution"]
        if not name:  # the distribution that installs this top-level package (Python 3.10+)
            if owners is None:
                owners = dict(getattr(md, "packages_distributions", dict)())
            found = owners.get(q["module"].split(".")[0]) or [""]
            name = found[0]
        if name and name not in dists:
            dists[name], out["distributions"][name] = _distribution(name)
        dist = dists.get(name)
        entry: dict[str, str | None] = {"file": None, "package_dir": None,
                                        "record_sha256": None, "distribution": name or None}
        out["modules"][q["module"]] = entry
        try:
            spec = importlib.util.find_spec(q["module"].split(".")[0])
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locations:
            continue
        entry["package_dir"] = os.path.realpath(locations[0])
        candidate = os.path.join(locations[0], *q["relative_path"].split("/"))
        if os.path.isfile(candidate):
            entry["file"] = candidate
        if dist is not None and entry["file"] is not None:
            if name not in files:
                files[name] = list(dist.files or ())  # RECORD, parsed once per distribution
            entry["record_sha256"] = _record_sha256(files[name], q["relative_path"],
                                                    os.path.realpath(candidate))
    return out


if __name__ == "__main__":
    print(json.dumps(answer(json.loads(sys.argv[1]))))
