"""Running the tool as the tests do: ``python -m hatch_vllm_patch`` as a subprocess (``cli``) or
in this process (``main_in_process``), doctor's and ``verify --deep``'s children batched, and a
shared environment left as it was installed (``pristine_environment``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from support import REPO
from support.venvs import SCRUBBED_ENV, run


@contextlib.contextmanager
def pristine_environment(python: Path) -> Iterator[None]:
    """Leave a shared environment as it was installed, also when the test fails half-way:
    edits discarded, every block of ours reverted, the record gone."""
    try:
        yield
    finally:
        sp = next((python.parent.parent / "lib").glob("python3*/site-packages"))
        record = sp / ".hatch-vllm-patch.json"
        if record.exists():
            for session in json.loads(record.read_text()).get("edits", {}).values():
                run([str(python), "-m", "hatch_vllm_patch", "edit", session["module"],
                     "--discard", "--python", str(python)], check=False)
        # --python: from a folder with a project's .venv (the checkout) that would be the target
        run([str(python), "-m", "hatch_vllm_patch", "revert", "--python", str(python)],
            check=False)
        record.unlink(missing_ok=True)


def doctor_batch(python: Path, cases: Mapping[str, Sequence[str]],
                 project: Path | None = None) -> dict[str, tuple[int, dict[str, Any]]]:
    """Each case's ``vllm-patch doctor`` options (parsed by the command's own parser), all
    diagnosed in one child of ``python``: per case, the exit code the command gives for it and
    its ``--json`` result. As the command run from this checkout: without ``project`` the
    project is the one found from the checkout, and the variables the tests scrub are unset."""
    from hatch_vllm_patch._cli import DOCTOR_EXIT, _parser, doctor_request
    from hatch_vllm_patch.config import find_project_dir
    from hatch_vllm_patch.doctor import run_doctor_many
    from hatch_vllm_patch.trust import Rule

    parser = _parser("doctor")
    requests = [doctor_request(parser.parse_args(["doctor", "--python", str(python), *args]))
                for args in cases.values()]
    here = REPO
    found = find_project_dir(here)
    project_dir, rule = ((project.resolve(), Rule.CHOSEN) if project is not None else
                         (found.path, found.rule) if found is not None else (here, Rule.CHOSEN))
    with pytest.MonkeyPatch.context() as env:
        for name in SCRUBBED_ENV:
            env.delenv(name, raising=False)
        reports = run_doctor_many(requests, project_dir=project_dir, python=str(python),
                                  project_rule=rule, timeout=900)
    return {name: (DOCTOR_EXIT[r.outcome], json.loads(json.dumps(r.to_json())))
            for name, r in zip(cases, reports, strict=True)}


def deep_probes(python: Path, *patch_ids: str) -> dict[str, tuple[bool | None, str]]:
    """The catalog patches' deep probes in ``python``'s environment, all in one child (as
    `verify --deep` runs them, but also for patches not applied): per patch (passed, detail)."""
    from hatch_vllm_patch.catalog import load_catalog
    from hatch_vllm_patch.deep import run_probes
    from hatch_vllm_patch.environment import InterpreterChoice, inspect_environment

    catalog = load_catalog()
    env = inspect_environment(InterpreterChoice(python, "given with --python"), [],
                              in_process=False)
    return {pid: tuple(v) for pid, v in  # type: ignore[misc]
            run_probes([catalog[pid] for pid in patch_ids], env).items()}


def cli(*args: str, cwd: Path | None = None, catalog: Path | None = None,
        check: bool = False, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m hatch_vllm_patch`` as a real subprocess."""
    extra = dict(env or {})
    if catalog is not None:
        extra["HATCH_VLLM_PATCH_CATALOG"] = str(catalog)
    return run([sys.executable, "-m", "hatch_vllm_patch", *args], cwd=cwd, env=extra,
               check=check)


def main_in_process(*args: str) -> tuple[int, str, str]:
    """``vllm-patch ARGS`` in this process (the target is this interpreter, probed in process);
    an exception escaping main() fails the test with its traceback."""
    import io

    from hatch_vllm_patch._cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()
