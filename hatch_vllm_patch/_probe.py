"""The environment probe: what a Python environment holds, as that interpreter sees it.

Runs either in this process (when the target is the running interpreter) or as the source of
``python -c`` in the target interpreter (any Python >= 3.8, where hatch-vllm-patch may not be
installed). So: standard library only, no import of this package, and no import of vLLM:
top-level packages are found with ``importlib.util.find_spec`` (which does not import a
top-level package), and distributions by their ``.dist-info`` folder in the site directories
on ``sys.path`` (never the working directory), in ``sys.path`` order as ``importlib.metadata``
finds them, read directly: ``METADATA``'s Name and Version, ``RECORD``'s lines,
``direct_url.json``. (``importlib.metadata`` itself would cost tens of milliseconds per run,
most of ``verify``'s time, for the same answers.)

Answer (JSON): ``executable``, ``prefix``, ``base_prefix``, ``python_version``, ``purelib``,
``pycache_prefix``, ``site_dirs`` (the site-packages folders on ``sys.path``, by real path),
``editable_trees`` (of every editable install on ``sys.path``),
``distributions`` {name: {name, version, editable, location, tree} | null} and ``modules``
{module: {file, package_dir, record_sha256, distribution, refused}}.

Targets are confined to their distribution, here and only here: a module's file is given only
when it is listed in its distribution's RECORD, or, for an editable install, lies inside that
install's own tree (``direct_url.json``). Any other file — the standard library, another
distribution's, a file the distribution does not install — is not given: ``refused`` says why,
and nothing reads or writes it.
"""

from __future__ import annotations

import base64
import contextlib
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
_SITE = ("site-packages", "dist-packages")


def _site_dirs() -> set[str]:
    """The environment's own site directories (real paths): those ``site`` and ``sysconfig``
    name, and every ``site-packages`` / ``dist-packages`` folder on sys.path (a parent
    environment's, added by a ``.pth`` file)."""
    import site

    found = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             *getattr(site, "getsitepackages", list)()]
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    found += [e for e in sys.path if e and os.path.basename(e.rstrip(os.sep)) in _SITE]
    return {os.path.realpath(d) for d in found if os.path.isdir(d)}


def _metadata_folder(name: str) -> str | None:
    """The first ``<name>-<version>.dist-info`` (or ``.egg-info``) folder in a site directory
    on sys.path, in sys.path order; each entry is listed once per process.

    Only site directories: never ``''`` nor the working directory, which a vLLM started with
    ``python -c`` / ``-m`` has first on sys.path, nor a script's folder (another user's fake
    ``vllm-0.99.0.dist-info`` there would otherwise stand for the installed vLLM). An editable
    install keeps its ``.dist-info`` in site-packages too; only its code lies elsewhere."""
    wanted = _normalize(name)
    sites: set[str] | None = None
    for entry in sys.path:
        if entry not in _FOLDERS:
            if sites is None:
                sites = _site_dirs()
            found: dict[str, str] = {}
            names: list[str] = []
            if entry and os.path.isabs(entry) and os.path.realpath(entry) in sites:
                with contextlib.suppress(OSError):
                    names = sorted(os.listdir(entry))
            for folder in names:
                stem, dot, kind = folder.rpartition(".")
                if dot and kind in ("dist-info", "egg-info"):
                    found.setdefault(_normalize(stem.split("-")[0]),
                                     os.path.join(entry, folder))
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
    text = _read(folder, "direct_url.json")
    tree = _tree(text)
    editable = tree is not None or _editable_flag(text)
    return folder, {"name": headers.get("Name", name), "version": headers["Version"],
                    "editable": editable, "location": folder, "tree": tree}


def _editable_trees() -> list[str]:
    """The trees of every editable install on sys.path (where its files may lie)."""
    trees = set()
    _metadata_folder("")  # lists every entry of sys.path (once per process)
    for entry in sys.path:
        for folder in _FOLDERS.get(entry, {}).values():
            if os.path.isfile(os.path.join(folder, "direct_url.json")):
                found = _tree(_read(folder, "direct_url.json"))
                if found:
                    trees.add(found)
    return sorted(trees)


def _editable_flag(text: str | None) -> bool:
    try:
        return bool(json.loads(text or "{}").get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        return False


def _tree(text: str | None) -> str | None:
    """The real path of an editable install's tree, from its ``direct_url.json``."""
    try:
        direct = json.loads(text or "{}")
        url = direct.get("url")
        if direct.get("dir_info", {}).get("editable") and isinstance(url, str) \
                and url.startswith("file://"):
            from urllib.parse import unquote, urlsplit

            return os.path.realpath(unquote(urlsplit(url).path))
    except (ValueError, AttributeError):
        pass
    return None


def _inside(path: str, folder: str) -> bool:
    """Is the real path ``path`` inside the real folder ``folder``?"""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _refusal(name: str, info: dict[str, Any] | None, file: str,
             record_sha256: str | None) -> str | None:
    """None when ``file`` belongs to the distribution ``name``; else why it is refused."""
    if record_sha256 is not None:
        return None
    real = os.path.realpath(file)
    if not name:
        return (f"{real} belongs to no installed distribution (the standard library, or a "
                "folder on sys.path)")
    if info is None:
        return f"{real} is not a file of {name}: {name} is not installed here"
    tree = info.get("tree")
    if info.get("editable") and tree and _inside(real, tree):
        return None
    where = (f"its editable tree {tree}" if info.get("editable") and tree
             else f"its RECORD ({info.get('location')})")
    return f"{real} is not a file of {name} {info.get('version')}: not in {where}"


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
        "site_dirs": sorted({os.path.realpath(e) for e in
                             [*sys.path, sysconfig.get_paths()["purelib"]]
                             if os.path.basename(e.rstrip(os.sep)) in
                             ("site-packages", "dist-packages") and os.path.isdir(e)}),
        "distributions": {}, "modules": {},
    }
    out["editable_trees"] = _editable_trees()
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
                                        "record_sha256": None, "distribution": name or None,
                                        "refused": None}
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
        if entry["file"] is not None:
            entry["refused"] = _refusal(name, out["distributions"].get(name), candidate,
                                        entry["record_sha256"])
            if entry["refused"] is not None:
                entry["file"] = None  # never read, never written
    return out


if __name__ == "__main__":
    print(json.dumps(answer(json.loads(sys.argv[1]))))
