"""The environment probe: what a Python environment holds, as that interpreter sees it.

Runs either in this process (when the target is the running interpreter) or as the source of
``python -c`` in the target interpreter (any Python >= 3.8, where hatch-vllm-patch may not be
installed). So: standard library only, no import of this package, and no import of vLLM:
top-level packages are found with ``importlib.util.find_spec`` (which does not import a
top-level package), and distributions by their ``.dist-info`` folder on ``sys.path``, in
``sys.path`` order as ``importlib.metadata`` finds them, read directly: ``METADATA``'s Name and
Version, ``RECORD``'s lines, ``direct_url.json``. (``importlib.metadata`` itself would cost
tens of milliseconds per run, most of ``verify``'s time, for the same answers.)

Answer (JSON): ``executable``, ``prefix``, ``base_prefix``, ``python_version``, ``purelib``,
``pycache_prefix``, ``distributions`` {name: {name, version, editable, location} | null} and
``modules`` {module: {file, package_dir, record_sha256, distribution}}.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import sys
import sysconfig
from typing import Any


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


_FOLDERS: dict[str, dict[str, str]] = {}  # sys.path entry -> normalized name -> folder


def _metadata_folder(name: str) -> str | None:
    """The first ``<name>-<version>.dist-info`` (or ``.egg-info``) folder on sys.path; each
    entry is listed once per process."""
    wanted = _normalize(name)
    for entry in sys.path:
        if entry not in _FOLDERS:
            found: dict[str, str] = {}
            try:
                names = sorted(os.listdir(entry or "."))
            except OSError:
                names = []
            for folder in names:
                stem, dot, kind = folder.rpartition(".")
                if dot and kind in ("dist-info", "egg-info"):
                    found.setdefault(_normalize(stem.split("-")[0]),
                                     os.path.join(entry or ".", folder))
            _FOLDERS[entry] = found
        path = _FOLDERS[entry].get(wanted)
        if path is not None and os.path.isdir(path):
            return path
    return None


def _read(folder: str, name: str) -> str | None:
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _distribution(name: str) -> tuple[str | None, dict[str, Any] | None]:
    """(metadata folder, {name, version, editable, location}) or (None, None)."""
    folder = _metadata_folder(name)
    if folder is None:
        return None, None
    headers: dict[str, str] = {}
    for line in (_read(folder, "METADATA") or _read(folder, "PKG-INFO") or "").splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in headers:
            headers[key] = value.strip()
    if "Version" not in headers:
        return None, None
    editable = False
    try:
        direct = json.loads(_read(folder, "direct_url.json") or "{}")
        editable = bool(direct.get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        pass
    return folder, {"name": headers.get("Name", name), "version": headers["Version"],
                    "editable": editable, "location": folder}


def _record_sha256(folder: str, record: str, relative_path: str, real: str) -> str | None:
    """The sha256 RECORD gives for the file whose real path is ``real`` (hex). RECORD paths are
    relative to the folder holding the .dist-info. Found by searching the text for the path's
    end (C speed: vLLM's RECORD has thousands of lines)."""
    needle = relative_path + ",sha256="
    start = record.find(needle)
    while start >= 0:
        line_start = record.rfind("\n", 0, start) + 1
        digest_start = start + len(needle)
        digest_end = record.find(",", digest_start)
        path = record[line_start:start + len(relative_path)]
        if os.path.realpath(os.path.join(os.path.dirname(folder), path)) == real:
            value = record[digest_start:digest_end if digest_end >= 0 else None].strip()
            return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
        start = record.find(needle, start + 1)
    return None


def _owners() -> dict[str, list[str]]:
    """Top-level package -> distributions (only when a module's distribution is not given)."""
    import importlib.metadata as md

    return dict(getattr(md, "packages_distributions", dict)())


def answer(queries: list[dict[str, str]]) -> dict[str, Any]:
    """The probe's answer for ``queries`` ([{distribution, module, relative_path}])."""
    out: dict[str, Any] = {
        "executable": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
        "python_version": ".".join(str(n) for n in sys.version_info[:3]),
        "purelib": sysconfig.get_paths()["purelib"],
        "pycache_prefix": getattr(sys, "pycache_prefix", None),
        "distributions": {}, "modules": {},
    }
    folders: dict[str, str | None] = {}
    records: dict[str, str] = {}
    owners: dict[str, list[str]] | None = None
    for q in queries:
        name = q["distribution"]
        if not name:  # the distribution that installs this top-level package (Python 3.10+)
            if owners is None:
                owners = _owners()
            found = owners.get(q["module"].split(".")[0]) or [""]
            name = found[0]
        if name and name not in folders:
            folders[name], out["distributions"][name] = _distribution(name)
        folder = folders.get(name)
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
        if folder is not None and entry["file"] is not None:
            if name not in records:
                records[name] = _read(folder, "RECORD") or ""
            entry["record_sha256"] = _record_sha256(folder, records[name], q["relative_path"],
                                                    os.path.realpath(candidate))
    return out


if __name__ == "__main__":
    print(json.dumps(answer(json.loads(sys.argv[1]))))
