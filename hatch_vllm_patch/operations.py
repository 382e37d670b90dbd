"""apply / verify / revert / status / diff: config -> selection -> plan -> write."""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .catalog import Catalog, Patch, load_catalog
from .config import Config, load_project_config
from .engine import (
    FileFacts,
    Plan,
    Verdict,
    parse_file,
    plan_apply,
    plan_revert,
    plan_verify,
    sha256_hex,
)
from .environment import (
    InterpreterChoice,
    ModuleQuery,
    TargetEnvironment,
    choose_interpreter,
    inspect_environment,
)
from .errors import TargetEnvironmentError, UsageError
from .files import Ledger, LedgerEntry, drop_bytecode, environment_lock, write_atomic
from .selection import Selection, select, unknown_architecture_notes

OPERATIONS = ("apply", "verify", "revert", "status", "diff")
_REGISTRY = ModuleQuery("vllm", "vllm.model_executor.models.registry",
                        "model_executor/models/registry.py")

# Verdicts that mean "nothing is wrong" for each operation.
_FINE = {
    "apply": {Verdict.APPLIED, Verdict.ALREADY_APPLIED, Verdict.NOT_NEEDED, Verdict.NOT_APPLICABLE},
    "verify": {Verdict.APPLIED, Verdict.NOT_NEEDED, Verdict.NOT_APPLICABLE},
    "revert": {Verdict.REVERTED, Verdict.NOT_APPLIED},
    "diff": {Verdict.APPLIED, Verdict.ALREADY_APPLIED, Verdict.NOT_NEEDED, Verdict.NOT_APPLICABLE},
    "status": set(Verdict),  # informational
}


@dataclass(frozen=True)
class PatchOutcome:
    """The verdict on one patch, and why."""

    patch_id: str
    verdict: Verdict
    reason: str
    ok: bool
    file: Path | None = None
    selected_because: tuple[str, ...] = ()
    diff: str | None = None
    next_step: str | None = None

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "id": self.patch_id,
            "verdict": self.verdict.value,
            "ok": self.ok,
            "reason": self.reason,
            "file": str(self.file) if self.file else None,
            "selected_because": list(self.selected_because),
        }
        if self.next_step:
            data["next_step"] = self.next_step
        if self.diff is not None:
            data["diff"] = self.diff
        return data


@dataclass(frozen=True)
class Report:
    """What one operation found and did in one environment."""

    operation: str
    environment: TargetEnvironment
    outcomes: tuple[PatchOutcome, ...]
    notes: tuple[str, ...] = ()
    project_dir: Path | None = None
    config_source: Path | None = None

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outcomes)

    def to_json(self) -> dict[str, object]:
        return {
            "operation": self.operation,
            "ok": self.ok,
            "project": str(self.project_dir) if self.project_dir else None,
            "config": str(self.config_source) if self.config_source else None,
            "environment": self.environment.to_json(),
            "patches": [o.to_json() for o in self.outcomes],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Request:
    """What the caller asked for (the CLI's options, or the build hook's)."""

    project_dir: Path | None = None
    python: str | None = None
    patches: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    models: tuple[Path, ...] = ()
    deep: bool = False
    catalog: Catalog | None = None
    config: Config | None = None  # given: used as is; None: read from the project


def _registered_architectures(env: TargetEnvironment) -> list[str] | None:
    """The architecture names in the installed vLLM's model registry (read, not imported)."""
    location = env.modules.get(_REGISTRY.module)
    if location is None or location.file is None:
        return None
    try:
        tree = ast.parse(location.file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    names: list[str] = []
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id.endswith("_MODELS")
                   and "PREVIOUSLY" not in t.id for t in targets):
            continue
        if isinstance(value, ast.Dict):
            names += [k.value for k in value.keys
                      if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return names or None


def _facts(patch: Patch, env: TargetEnvironment, ledger: Ledger) -> FileFacts:
    location = env.modules[patch.target.module]
    version = env.version_of(patch.target.distribution)
    path = location.file
    if version is None and path is not None:
        version = "unknown"  # importable (e.g. a bare checkout on PYTHONPATH) but no metadata
    content: bytes | None = None
    if path is not None:
        try:
            content = path.read_bytes()
        except FileNotFoundError:
            content = None
    entry = ledger.get(path) if path else None
    shown = path or (location.package_dir / patch.target.relative_path
                     if location.package_dir else Path(patch.target.relative_path))
    return FileFacts(
        path=str(shown),
        content=content,
        installed_version=version,
        record_sha256=location.record_sha256,
        ledger_original_sha256=entry.original_sha256 if entry else None,
    )


def _next_step(verdict: Verdict, patch: Patch, env: TargetEnvironment) -> str | None:
    target, python = patch.target.distribution, env.python
    version = env.version_of(target)
    if verdict is Verdict.MISSING or verdict is Verdict.STALE:
        return f"run: python -m hatch_vllm_patch apply --python {python} --patch {patch.id}"
    if verdict is Verdict.MODIFIED:
        return (f"restore the original with: uv pip install --python {python} --reinstall "
                f"--no-deps {target}=={version}, then apply again")
    if verdict is Verdict.UNKNOWN_SHAPE:
        return (f"this {target} is not one the patch knows: check whether upstream fixed it "
                f"({', '.join(patch.links[:1]) or patch.id}); do not force it")
    if verdict is Verdict.NOT_INSTALLED and not patch.target.optional:
        return f"install {target} into {python} first (e.g. uv sync)"
    return None


def _write(plan: Plan, path: Path, patch: Patch, env: TargetEnvironment, ledger: Ledger,
           original_sha256: str) -> None:
    assert plan.new_content is not None
    write_atomic(path, plan.new_content)
    drop_bytecode(path)
    parsed = parse_file(plan.new_content)
    ledger.record(LedgerEntry(
        path=str(path),
        distribution=patch.target.distribution,
        distribution_version=env.version_of(patch.target.distribution) or "unknown",
        original_sha256=original_sha256,
        patched_sha256=sha256_hex(plan.new_content),
        patches={b.patch_id: b.declared_sha256 for b in parsed.blocks},
    ))


def _run_probe(patch: Patch, env: TargetEnvironment) -> tuple[bool, str]:
    """Run the patch's deep probe in the target interpreter; (passed, detail)."""
    assert patch.probe_path is not None
    try:
        proc = subprocess.run([str(env.python), str(patch.probe_path)], capture_output=True,
                              text=True, timeout=900, check=False,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"probe did not run: {exc}"
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "ok" in data:
            return bool(data["ok"]) and proc.returncode == 0, str(data.get("detail", ""))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return False, f"probe exited {proc.returncode} without a verdict: {tail}"


def _unified_diff(path: Path, env: TargetEnvironment, old: bytes, new: bytes) -> str:
    """A ``diff -u`` of one file, named relative to site-packages where it lies there."""
    try:
        label = path.relative_to(env.purelib).as_posix()
        names = (f"a/{label}", f"b/{label}")
    except ValueError:
        names = (str(path), str(path))
    return "".join(difflib.unified_diff(
        old.decode("utf-8", "replace").splitlines(keepends=True),
        new.decode("utf-8", "replace").splitlines(keepends=True),
        fromfile=names[0], tofile=names[1],
    ))


def resolve(request: Request) -> tuple[Catalog, Config | None, Selection, InterpreterChoice]:
    """The pure-ish front half shared by every operation and the build hook: no writes."""
    catalog = request.catalog or load_catalog()
    project_dir = request.project_dir
    config = request.config
    if config is None and project_dir is not None:
        config = load_project_config(project_dir, catalog)
    selection = select(catalog, config, patches=request.patches,
                       architectures=request.architectures, models=request.models)
    choice = choose_interpreter(project_dir, request.python, config.python if config else None)
    return catalog, config, selection, choice


def run(operation: str, request: Request) -> Report:
    """Carry out ``operation``; raise ConfigurationError / UsageError / TargetEnvironmentError."""
    if operation not in OPERATIONS:
        raise UsageError(f"unknown operation {operation!r}; expected one of {OPERATIONS}")
    catalog, config, selection, choice = resolve(request)
    patches: Sequence[Patch] = selection.patches
    why = dict(selection.why)
    if not patches and operation in {"revert", "status"}:
        patches = catalog.patches  # revert/status everything we know by default
        why = {p.id: ("all catalog patches",) for p in patches}
    queries = {p.target.module: ModuleQuery(p.target.distribution, p.target.module,
                                            p.target.relative_path) for p in patches}
    if selection.architectures:
        queries[_REGISTRY.module] = _REGISTRY
    env = inspect_environment(choice, queries.values())
    notes = list(selection.notes)
    known = _registered_architectures(env) if selection.architectures else None
    if known:
        notes += unknown_architecture_notes(selection.architectures, known)
    if not patches:
        raise UsageError("\n".join([
            "no patches selected: add [tool.vllm-patch] to pyproject.toml "
            f"(in {request.project_dir or Path.cwd()}), or pass --patch ID, "
            "--architecture NAME or --model DIR",
            *(f"note: {n}" for n in notes),
        ]))

    writes = operation in {"apply", "revert"}
    outcomes: list[PatchOutcome] = []
    ledger = Ledger(env.purelib)
    try:
        lock = environment_lock(env.purelib) if writes else contextlib.nullcontext()
        with lock:
            for patch in patches:
                outcomes.append(_one(operation, patch, env, ledger, request.deep,
                                     tuple(why.get(patch.id, ()))))
            if writes:
                ledger.save()
    except OSError as exc:
        raise TargetEnvironmentError(
            f"cannot write in {env.purelib} ({choice.reason}): {exc}; run as the environment's "
            "owner, or pass --python for an environment you can write"
        ) from None
    project = request.project_dir
    return Report(operation, env, tuple(outcomes), tuple(notes), project,
                  config.source if config else None)


def _one(operation: str, patch: Patch, env: TargetEnvironment, ledger: Ledger, deep: bool,
         why: tuple[str, ...]) -> PatchOutcome:
    facts = _facts(patch, env, ledger)
    path = Path(facts.path)
    if operation == "revert":
        plan = plan_revert(patch, facts)
    elif operation in {"apply", "diff"}:
        plan = plan_apply(patch, facts)
    else:
        plan = plan_verify(patch, facts)
    diff = None
    if operation == "diff" and plan.new_content is not None and facts.content is not None:
        diff = _unified_diff(path, env, facts.content, plan.new_content)
        plan = replace(plan, reason=f"would apply: {plan.reason}")
    elif operation in {"apply", "revert"} and plan.new_content is not None:
        assert facts.content is not None
        original = parse_file(facts.content).original
        try:
            _write(plan, path, patch, env, ledger, sha256_hex(original))
        except OSError as exc:
            plan = Plan(Verdict.ERROR, f"could not write {path}: {exc}")
    optional_absent = plan.verdict is Verdict.NOT_INSTALLED and patch.target.optional
    ok = plan.verdict in _FINE[operation] or optional_absent
    reason = plan.reason
    if operation == "verify" and deep and plan.verdict is Verdict.APPLIED:
        if patch.probe_path is None:
            reason += "; no deep probe for this patch"
        else:
            passed, detail = _run_probe(patch, env)
            if passed:
                reason += f"; deep probe passed: {detail}"
            else:
                plan = Plan(Verdict.ERROR, f"deep probe failed: {detail}")
                reason, ok = plan.reason, False
    return PatchOutcome(
        patch_id=patch.id,
        verdict=plan.verdict,
        reason=reason,
        ok=ok,
        file=path if facts.content is not None else None,
        selected_because=why,
        diff=diff,
        next_step=None if ok else _next_step(plan.verdict, patch, env),
    )


def apply(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("apply", _request(project_dir, options))


def verify(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("verify", _request(project_dir, options))


def revert(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("revert", _request(project_dir, options))


def status(project_dir: Path | str | None = None, **options: object) -> Report:
    return run("status", _request(project_dir, options))


def _request(project_dir: Path | str | None, options: dict[str, object]) -> Request:
    def seq(name: str) -> tuple[str, ...]:
        value = options.pop(name, ()) or ()
        return (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]

    patches, architectures = seq("patches"), seq("architectures")
    models = tuple(Path(m) for m in seq("models"))
    python = options.pop("python", None)
    deep = bool(options.pop("deep", False))
    config = options.pop("config", None)
    if options:
        raise TypeError(f"unexpected options: {', '.join(sorted(options))}")
    return Request(
        project_dir=Path(project_dir).resolve() if project_dir is not None else None,
        python=str(python) if python is not None else None,
        patches=patches,
        architectures=architectures,
        models=models,
        deep=deep,
        config=config if isinstance(config, Config) else None,
    )

