"""The whole: prepare each request, run the child once, judge its answer with every judgement
above; ``run_doctor`` for the CLI.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..catalog import RUNTIME_SETTINGS, Patch
from ..engine import Verdict
from ..environment import ModuleQuery, TargetEnvironment
from ..errors import ConfigurationError, TargetEnvironmentError, UsageError
from ..models import read_model
from ..report import Report
from ..trust import Rule

if TYPE_CHECKING:
    from ..operations import Request
from .inputs import attention_backend_names, check_backend_name, check_path_options, resolve_model
from .job import (
    PLANNING_MODULES,
    PROBE_TIMEOUT,
    backend_of,
    backend_unavailable,
    blocks_of,
    case_of,
    combined,
    compatible,
    concerns,
    modelled_of,
    run_child,
    variants,
)
from .memory import memory_advice
from .model_folder import (
    INSPECTION_FAILED,
    inspection_cause,
    native_copy,
    refuse_unregistered,
    remote_code_of,
    unregistered_override,
)
from .neuron import judge_neuron, neuron_line
from .prefix import judge_prefix
from .report import (
    INSTALLED,
    PLATFORMS,
    RECOMMENDED,
    DoctorReport,
    DoctorRequest,
    NeuronBudget,
    Run,
    RuntimeAdvice,
)
from .runtime import runtime_advice
from .startup import _err, config_lines, judge, run_of


class _Prepared(NamedTuple):
    """One request, checked and ready for the child: its case, its variants, and what judging
    its answer needs."""

    request: DoctorRequest  # with the draft model's path resolved
    model_dir: Path
    model_is_dir: bool
    architecture: str
    case: dict[str, Any]  # the child's case, with its own "variants"
    candidates: tuple[Patch, ...]
    missing: tuple[Patch, ...]
    in_place: tuple[str, ...]
    notes: tuple[str, ...]
    runtime: tuple[RuntimeAdvice, ...] = ()


def diagnose(request: DoctorRequest, env: TargetEnvironment, patches: Mapping[str, Patch],
             verdicts: Mapping[str, Verdict], registered: Sequence[str] | None,
             *, timeout: float = PROBE_TIMEOUT, modules: Mapping[str, str] | None = None,
             everything: bool = False, prefer: Collection[str] = (),
             on_import: Callable[[], None] | None = None) -> DoctorReport:
    """Run the child for ``request`` and judge it. ``verdicts`` are the status of every
    patch in ``patches`` in this environment; ``modules`` each registered architecture's
    module. Only patches that concern the model are tried (``concerns``), every one with
    ``everything``; those in ``prefer`` (the project's selection) come first, then the
    catalog's, when two of them replace one symbol."""
    [report] = diagnose_many([request], env, patches, verdicts, registered, timeout=timeout,
                             modules=modules, everything=everything, prefer=prefer,
                             on_import=on_import)
    return report


def diagnose_many(requests: Sequence[DoctorRequest], env: TargetEnvironment,
                  patches: Mapping[str, Patch], verdicts: Mapping[str, Verdict],
                  registered: Sequence[str] | None, *, timeout: float = PROBE_TIMEOUT,
                  modules: Mapping[str, str] | None = None, everything: bool = False,
                  prefer: Collection[str] = (),
                  on_import: Callable[[], None] | None = None) -> list[DoctorReport]:
    """:func:`diagnose` for each of ``requests``, all in one child of the target (one import
    of vLLM), each case with its own variants; one report per request, in order, each what
    :func:`diagnose` gives for it alone. Every request is checked before the child starts (a
    UsageError names the first bad one); ``timeout`` is per request."""
    if not requests:
        return []
    with tempfile.TemporaryDirectory(prefix="hvp-doctor-model-") as scratch:
        prepared = []
        for index, request in enumerate(requests):
            folder = Path(scratch) / str(index)
            folder.mkdir()
            prepared.append(_prepare(request, env, patches, verdicts, registered, modules,
                                     everything, prefer, folder))
        neuron = env.version_of("vllm-neuron") is not None
        job = {"cases": [p.case for p in prepared], "neuron": neuron}
        if on_import is not None:  # every input is checked: now the slow part starts
            on_import()
        answer = run_child(env.python, job, timeout=timeout * len(prepared))
        return [_conclude(p, answer["vllm"], answer["cases"][i], env, patches, neuron,
                          verdicts, modules, timeout) for i, p in enumerate(prepared)]


def _prepare(request: DoctorRequest, env: TargetEnvironment, patches: Mapping[str, Patch],
             verdicts: Mapping[str, Verdict], registered: Sequence[str] | None,
             modules: Mapping[str, str] | None, everything: bool, prefer: Collection[str],
             scratch: Path) -> _Prepared:
    """Check ``request`` and build its case: the model (a native copy in ``scratch`` where
    vLLM registers a remote-code architecture itself), the patches to try, the variants."""
    if request.platform not in PLATFORMS:
        raise UsageError(f"--platform {request.platform}: expected one of {', '.join(PLATFORMS)}")
    model_is_dir = Path(request.model).expanduser().is_dir()
    model_dir = resolve_model(request.model)
    notes: list[str] = []
    overrides = dict(request.hf_overrides or {})
    if "architectures" not in overrides:
        auto, note = unregistered_override(model_dir, registered)
        if auto:
            overrides.update(auto)
            notes.append(note or "")
    if not request.trust_remote_code:  # the model's own code may bring its class
        refuse_unregistered(overrides.get("architectures") or read_model(
            model_dir, "--model").architectures, registered, request.model,
            "--hf-overrides" if request.hf_overrides and "architectures" in request.hf_overrides
            else f"{model_dir}/config.json")
    speculative = dict(request.speculative_config or {})
    if isinstance(speculative.get("model"), str) and speculative.get("method") != "mtp":
        speculative["model"] = str(resolve_model(speculative["model"],
                                                 option="--speculative-config model"))
    request = request._replace(speculative_config=speculative or None)
    info = read_model(model_dir, "--model")
    architecture = (overrides.get("architectures") or info.architectures or ["?"])[0]
    names = {architecture, *info.architectures, *info.families}
    draft = speculative.get("model")
    if isinstance(draft, str) and Path(draft).is_dir():
        with contextlib.suppress(UsageError, ValueError, OSError):
            names.update(read_model(Path(draft), "--speculative-config model").architectures)
    model_modules = {(modules or {})[n] for n in names if n in (modules or {})}
    missing = [patches[pid] for pid, v in verdicts.items() if v is Verdict.MISSING]
    # A plugin's patch (vllm-neuron's) concerns the platform that plugin is, whatever the model:
    # where the plugin is installed, it is tried as the platform's budget is asked.
    platform_of = {"vllm-neuron"} if env.version_of("vllm-neuron") is not None else set()
    chosen = [p for p in missing
              if everything or concerns(p, names, model_modules, prefer)
              or p.target.distribution in platform_of]
    # A patch of vLLM's KV planning that names no architecture (exact groups) concerns every
    # model's memory: tried alone (not in the together run, which answers whether it starts),
    # so the memory line weighs it, gain and cost, without --all.
    planning_only = [p for p in missing if p not in chosen and not p.architectures and any(
        m.target.module in PLANNING_MODULES for m in p.parts)]
    if len(chosen) + len(planning_only) < len(missing):
        notes.append(f"not tried: {len(missing) - len(chosen) - len(planning_only)} patch(es) "
                     "for other models or settings (--all tries every patch)")
    own = {p.id for p in chosen if p.folder.parent != _catalog_root(patches)}
    candidates = sorted(chosen, key=lambda p: (p.id not in prefer, p.id in own))
    in_place = tuple(pid for pid, v in verdicts.items() if v is Verdict.APPLIED)
    job_variants = variants(candidates) + [
        {"name": p.id, "patches": [p.id], "blocks": blocks_of(p)} for p in planning_only]
    candidates += planning_only
    loaded_from = model_dir
    if not request.trust_remote_code and remote_code_of(model_dir) and registered \
            and architecture in registered:
        loaded_from = native_copy(model_dir, scratch)
        notes.append(f"{model_dir}/config.json names remote code (auto_map), but vLLM "
                     f"registers {architecture} itself: doctor loaded it natively, "
                     "without the model's code (pass --trust-remote-code to run that "
                     "code instead, as `vllm serve` must where transformers does not "
                     f"know model_type {info.model_type!r})")
    case = case_of(request, loaded_from, overrides or None, request.trust_remote_code)
    case["native_config"] = loaded_from != model_dir
    case["variants"] = job_variants
    return _Prepared(request, model_dir, model_is_dir, architecture, case, tuple(candidates),
                     tuple(missing), in_place, tuple(notes),
                     runtime_advice(patches, verdicts, names, request))


def _conclude(prepared: _Prepared, vllm: str, answer: dict[str, Any], env: TargetEnvironment,
              patches: Mapping[str, Patch], neuron_asked: bool,
              verdicts: Mapping[str, Verdict], modules: Mapping[str, str] | None,
              timeout: float) -> DoctorReport:
    """Judge one case's answer (``answer``: its entry of the child's ``cases``)."""
    request, architecture = prepared.request, prepared.architecture
    candidates, notes = prepared.candidates, list(prepared.notes)
    unavailable = backend_unavailable(answer["variants"][INSTALLED])
    if unavailable:
        raise TargetEnvironmentError(f"--attention-backend {backend_of(request)[0]}: doctor "
                                     f"cannot model it in {env.python}: {unavailable}")
    needed, verdict, runs, notes = _recommend(prepared.case, answer, candidates, patches, env,
                                              timeout, notes)
    if INSPECTION_FAILED in json.dumps(answer["variants"][INSTALLED]):
        cause = inspection_cause(env.python, architecture, (modules or {}).get(architecture),
                                 timeout)
        notes.append(cause)
        if not needed and cause.startswith("vLLM could not inspect"):
            verdict += "; the cause is in this environment, not in vLLM (see the note)"
    neuron = tuple(NeuronBudget(name, b.get("bytes_per_token"), b.get("max_concurrency"),
                                b.get("layers"), _err(b.get("error")))
                   for name, b in (answer.get("neuron") or {}).items()) if neuron_asked else ()
    neuron_needed, neuron_verdict = judge_neuron(neuron)
    if neuron_needed:
        needed = (*needed, *(p for p in neuron_needed if p not in needed))
        verdict = f"{verdict}; {neuron_verdict}"
    if neuron:
        notes.append("the vllm-neuron plugin is vLLM's platform here: its config hook ran in "
                     "the config step; the block-size step is the one of --platform")
    planning = [p.id for p in prepared.missing if any(m.target.module in PLANNING_MODULES
                                                      for m in p.parts)]
    tried = {p.id for p in candidates}
    memory = memory_advice(
        runs, [pid for pid in planning if pid in tried],
        answer["variants"][INSTALLED].get("facts"), request.platform,
        untried=[pid for pid in planning if pid not in tried])
    if memory is not None and memory.recommended:
        if not needed and runs[0].starts:  # the table's layouts are weighed by the memory line
            verdict = "starts as installed: nothing needed to start"
        verdict = f"{verdict}; for memory, recommended: {memory.line}"
    runtime = tuple(a.patch for a in prepared.runtime if a.to_select)
    if runtime:
        settings = sorted({RUNTIME_SETTINGS[a.setting] for a in prepared.runtime if a.to_select})
        verdict = (f"{verdict}; for {' and '.join(settings)}, select: {', '.join(runtime)} "
                   "(named from the setup, not measured: see the runtime line)")
    selected = needed or memory.recommended if memory else needed
    lines = config_lines((*selected, *(p for p in runtime if p not in selected)), architecture,
                         request.model, prepared.model_is_dir)
    patched = {name: raw["prefix"] for name, raw in answer["variants"].items()
               if name != INSTALLED and name in patches and raw.get("prefix")}
    prefix = judge_prefix(answer["variants"][INSTALLED].get("prefix"), patches, verdicts,
                          request.platform, patched)
    return DoctorReport(env, vllm, request, prepared.model_dir, architecture, runs,
                        tuple(p.id for p in candidates), prepared.in_place, needed, lines,
                        verdict, tuple(notes), neuron, neuron_line(env), memory, prefix,
                        modelled_of(request, answer["variants"][INSTALLED]), prepared.runtime)


def _recommend(case: dict[str, Any], answer: dict[str, Any], candidates: Sequence[Patch],
               patches: Mapping[str, Patch], env: TargetEnvironment, timeout: float,
               notes: list[str]) -> tuple[tuple[str, ...], str, tuple[Run, ...], list[str]]:
    """Judge the child's answer for ``case``; never two patches of one symbol; when the
    recommended combination was not among the runs, run it (what ``apply`` would write)."""
    raw = answer["variants"]
    runs = tuple(run_of(v, raw[v["name"]]) for v in case["variants"])
    needed, verdict = judge(runs, [p.id for p in candidates])
    kept, left_out = compatible([patches[p] for p in needed])
    if len(kept) < len(needed):
        needed = tuple(p.id for p in kept)
        notes = [*notes, *left_out]
    if len(needed) > 1 and not any(set(r.patches) == set(needed) for r in runs):
        extra = combined(RECOMMENDED, kept)
        again = run_child(env.python, {"cases": [{**case, "variants": [extra]}],
                                       "neuron": False}, timeout=timeout)
        together = run_of(extra, again["cases"][0]["variants"][RECOMMENDED])
        runs = (*runs, together)
        if not together.starts:
            needed = needed[:1]
            verdict += f"; with {', '.join(together.patches[1:])} as well it does not start"
    return needed, verdict, runs, notes


def _catalog_root(patches: Mapping[str, Patch]) -> Path | None:
    root = getattr(patches, "root", None)
    return root if isinstance(root, Path) else None


def patch_verdicts(outcomes: Iterable[Any]) -> dict[str, Verdict]:
    """One verdict per patch from ``status``'s outcomes, which are one per patch already (the
    engine decides a patch over several targets once: ``engine.decide_patch``). Where an id
    comes twice (a patch that ``replaces`` another is asked in a status of its own), the
    status that selected it speaks, not the other's ``not-selected`` of its block."""
    verdicts: dict[str, Verdict] = {}
    for outcome in outcomes:
        if verdicts.get(outcome.patch_id, Verdict.NOT_SELECTED) is Verdict.NOT_SELECTED:
            verdicts[outcome.patch_id] = outcome.verdict
    return verdicts


def catalog_status(base: Request, catalog: Mapping[str, Patch]
                   ) -> tuple[Report, dict[str, Verdict]]:
    """``status`` of every catalog patch in ``base``'s environment: the report (its environment
    and notes) and one verdict per patch. A patch that ``replaces`` another present one is
    asked in a second selection of its own, so that the one it replaces gets its verdict too
    (one selection of both leaves it out, with a note as if the user had selected both)."""
    from ..operations import run

    replacers = tuple(pid for pid in catalog
                      if any(old in catalog for old in catalog[pid].replaces))
    status = run("status", base._replace(
        patches=tuple(pid for pid in catalog if pid not in replacers)))
    outcomes = list(status.outcomes)
    if replacers:
        outcomes += run("status", base._replace(patches=replacers)).outcomes
    return status, patch_verdicts(o for o in outcomes if o.patch_id in catalog)


def run_doctor(request: DoctorRequest, *, project_dir: Path | None, python: str | None,
               timeout: float = PROBE_TIMEOUT, project_rule: Rule = Rule.CHOSEN,
               everything: bool = False,
               on_import: Callable[[], None] | None = None) -> DoctorReport:
    """Every catalog and project patch's status in the target environment, then
    :func:`diagnose` (``everything``: try every patch, not only those for the model).
    Raises UsageError / ConfigurationError / TargetEnvironmentError; a project that selects
    two patches of one symbol is refused as ``apply`` refuses it."""
    [report] = run_doctor_many([request], project_dir=project_dir, python=python,
                               timeout=timeout, project_rule=project_rule,
                               everything=everything, on_import=on_import)
    return report


# vLLM's enum of its attention backends (their names, as --attention-backend takes them), and
# where older releases may keep it.
BACKENDS_REGISTRIES = (
    ModuleQuery("vllm", "vllm.v1.attention.backends.registry",
                "v1/attention/backends/registry.py"),
    ModuleQuery("vllm", "vllm.attention.backends.registry", "attention/backends/registry.py"))


def run_doctor_many(requests: Sequence[DoctorRequest], *, project_dir: Path | None,
                    python: str | None, timeout: float = PROBE_TIMEOUT,
                    project_rule: Rule = Rule.CHOSEN, everything: bool = False,
                    on_import: Callable[[], None] | None = None) -> list[DoctorReport]:
    """:func:`run_doctor` for each of ``requests`` (models, settings) against one project
    and environment: the status and the registry are read once and vLLM is imported once,
    in one child for all of them (:func:`diagnose_many`); one report per request, in order."""
    from ..environment import inspect_environment
    from ..operations import _REGISTRY, Request, resolve
    from ..selection import architecture_modules, registered_architectures

    # Usage errors first, before the environment is asked: the model directory, and its
    # config.json read (bounded: size, depth) before any process is started with it.
    for request in requests:
        try:
            read_model(resolve_model(request.model), "--model")
        except ConfigurationError as exc:
            raise UsageError("; ".join(exc.errors)) from None
        if request.platform not in PLATFORMS:
            raise UsageError(f"--platform {request.platform}: expected one of "
                             f"{', '.join(PLATFORMS)}")
        check_path_options(request)
    base = Request(project_dir=project_dir, python=python, project_rule=project_rule)
    catalog, config, selection, choice, *_ = resolve(base)
    status, verdicts = catalog_status(base, catalog)
    if status.environment.version_of("vllm") is None:
        raise TargetEnvironmentError(
            f"vllm is not installed in {status.environment.python} ({choice.reason}): doctor "
            "runs the installed vLLM's own code; pass --python for the environment that serves")
    found = inspect_environment(choice, [_REGISTRY, *BACKENDS_REGISTRIES]).modules
    registry = found[_REGISTRY.module].file
    if any(r.attention_backend for r in requests):
        names = next((n for q in BACKENDS_REGISTRIES
                      if (n := attention_backend_names(found[q.module].file))), None)
        for request in requests:
            check_backend_name(request, names)
    selected = {p.id for p in selection.patches}
    reports = diagnose_many(requests, status.environment, catalog, verdicts,
                            registered_architectures(registry), timeout=timeout,
                            modules=architecture_modules(registry), everything=everything,
                            prefer=selected, on_import=on_import)
    out = []
    for report in reports:
        notes = [*status.notes, *report.notes]
        if config is not None and report.needed and set(report.needed) <= selected:
            notes.append(f"[tool.vllm-patch] in {config.source} already selects "
                         f"{', '.join(report.needed)}: `vllm-patch apply` puts it in place")
        out.append(report._replace(notes=tuple(notes)))
    return out
