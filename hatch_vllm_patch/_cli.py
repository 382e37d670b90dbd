"""The command line: argparse, :func:`main` and what ends it. With the ``_cli_*`` modules beside
it (what each command prints) it is the only code that prints or exits.

Exit codes: 0 every selected patch is applied or not needed; 1 something is missing, stale,
refused or failed; 2 usage or configuration error; 130 interrupted (Ctrl-C).

Every outcome, success or failure, is rendered in one place (:func:`._cli_output._finish`): as
text, or with ``--json`` as one object of the schema in ``schema/output.schema.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO, cast

from . import __version__
from ._cli_output import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    _ArgumentError,
    _Failure,
    _failure,
    _finish,
    _notice,
    _Outcome,
    _write,
)
from ._cli_output import SCHEMA_VERSION as SCHEMA_VERSION  # defined here before: kept importable
from .errors import (
    CatalogError,
    ConfigurationError,
    InterpreterNotFoundError,
    TargetEnvironmentError,
    UnusableInterpreterError,
    UsageError,
)
from .operations import Request, run

if TYPE_CHECKING:
    from .doctor import DoctorRequest
    from .trust import Rule

_HELP = {
    "apply": "patch the target environment (idempotent)",
    "verify": "check that every selected patch is in place; changes nothing",
    "revert": "remove our patches, restoring the files installed by the wheel (without --patch: "
              "every block of ours in the environment, other projects' too)",
    "status": "show the state of each patch (all catalog patches when none is selected); "
              "reports only, exit 0: verify is the check",
    "diff": "show what apply would change, as a unified diff; changes nothing",
}


_AUTHORING = {
    "edit": "make an installed module safe to edit in place (its own file, pristine bytes "
            "kept); prints its path",
    "create": "turn the edit of a module into a patch folder of the project, restore the "
              "module, select the patch in pyproject.toml and apply it",
    "update": "merge a project patch onto the installed release, symbol by symbol (three-way); "
              "conflicts open the module for editing",
    "new": "scaffold a patch folder with a wrapper of MODULE:SYMBOL that calls the original",
    "check": "validate patch folders (default: the project's patch-dir)",
}

_INIT = ("set this project up by its shape: [tool.vllm-patch] and the build hook, or the "
         "companion command; shows the diff, then writes it")
_INIT_EPILOG = ("exit codes: 0 written, or nothing to change (or --dry-run); 2 usage: what "
                "init cannot do without guessing, nothing written. docs: "
                "docs/how-to/install.md#set-a-project-up-vllm-patch-init")
_DOCTOR = ("will MODEL start on the installed vLLM, and which patch does it need? (runs vLLM's "
           "start-up KV steps in the target environment, on CPU, offline, without weights)")
EXIT_PATCH_NEEDED = 3
DOCS_EPILOG = ("docs: docs/ in the source (uv run mkdocs serve); the reference of every command: "
               "docs/reference/cli.md")
# doctor's exit codes, by DoctorReport.outcome (2: usage, as every command)
DOCTOR_EXIT = {"nothing-needed": EXIT_OK, "no-fix": EXIT_FAILED,
               "patch-needed": EXIT_PATCH_NEEDED}
_DOCTOR_EPILOG = ("exit codes: 0 it starts as installed, no patch needed; 3 a patch is needed "
                  "(it does not start without it, or sizes the recurrent state wrongly): "
                  "select the lines shown; 1 it does not start and no patch here fixes it, "
                  "or the probe could not run; 2 usage")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so that ``--json`` gets JSON."""

    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(f"{self.prog}: {message}", self.format_usage().strip())


def version_text() -> tuple[str, int]:
    """``vllm-patch --version``'s line and exit code: the package's version, and the catalog's:
    the built-in catalog ships in the wheel, so its version is the package's; its patch count
    and content digest (:func:`~.catalog.catalog_digest`) tell apart two checkouts that carry
    one version number between releases. A catalog named by ``$HATCH_VLLM_PATCH_CATALOG`` has
    no version of its own and is named as such."""
    from .catalog import CATALOG_ENV, catalog_digest, load_catalog

    try:
        catalog = load_catalog()
        digest = catalog_digest(catalog)
    except CatalogError as exc:
        first = str(exc).splitlines()[0]
        return f"vllm-patch {__version__} (catalog unreadable: {first})", EXIT_FAILED
    which = f"from ${CATALOG_ENV}" if os.environ.get(CATALOG_ENV) else __version__
    count = f"{len(catalog)} patch{'es' if len(catalog) != 1 else ''}"
    return f"vllm-patch {__version__} (catalog {which}: {count}, sha256 {digest[:12]})", EXIT_OK


class _VersionAction(argparse.Action):
    """``--version``: reads the catalog only when asked (argparse's own action would take a
    string made each time the parser is built)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> NoReturn:
        line, code = version_text()
        _write(lambda: print(line))
        parser.exit(code)


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line. With ``only`` (the command given) just that command's parser is built:
    argparse looks up translations for every help text it adds, which made building all nine
    a tenth of a ``verify``."""
    where = _Parser(add_help=False)
    where.add_argument("--python", metavar="PATH",
                       help="target interpreter or environment directory "
                            "(default: [tool.vllm-patch] python, $UV_PROJECT_ENVIRONMENT, "
                            "<project>/.venv, then this interpreter)")
    where.add_argument("--project", metavar="DIR", type=Path, default=None,
                       help="project whose pyproject.toml holds [tool.vllm-patch] "
                            "(default: the nearest pyproject.toml from the current directory "
                            "up, as uv finds it)")
    common = _Parser(add_help=False, parents=[where])
    common.add_argument("--patch", metavar="ID", action="append", default=[], dest="patches",
                        help="select this patch (repeatable); overrides the project's selection")
    common.add_argument("--architecture", metavar="NAME", action="append", default=[],
                        dest="architectures",
                        help="select the patches for this model architecture (repeatable)")
    common.add_argument("--model", metavar="DIR|HUB_ID", action="append", default=[],
                        dest="models",
                        help="select the patches for the model in DIR, or of a hub id "
                             "(Org/Name) in the local Hugging Face cache (reads its "
                             "config.json; offline)")
    common.add_argument("--json", action="store_true",
                        help="print one machine-readable JSON object")
    parser = _Parser(
        prog="vllm-patch",
        description="Patch vLLM's installed files for hybrid models, verifiably and reversibly.",
        epilog=DOCS_EPILOG,
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="show the version and the catalog's, and exit")
    sub = parser.add_subparsers(dest="operation", metavar="COMMAND", required=True)
    for name, text in _HELP.items():
        if only is not None and name != only:
            continue
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        if name == "verify":
            p.add_argument("--deep", action="store_true",
                           help="also import the patched modules in the target environment and "
                                "exercise them (slow: imports vLLM)")
            p.add_argument("--strict", action="store_true",
                           help="also fail (exit 1) for a block in place that the selection "
                                "does not name (another project's, an `apply --patch` addition)")
        if name == "status":
            length = p.add_mutually_exclusive_group()
            length.add_argument("--short", action="store_true",
                                help="one line per patch: id, verdict, file")
            length.add_argument("-v", "--verbose", action="store_true",
                                help="also each patch's file, why it is selected, and its "
                                     "account: summary, why, links, when to remove it")
    if only is None or only == "doctor":
        _doctor_parser(sub, where)
    if only is None or only == "init":
        _init_parser(sub)
    for name, text in _AUTHORING.items():
        if only is not None and name != only:
            continue
        p = sub.add_parser(name, parents=[where], help=text, description=text)
        p.add_argument("--json", action="store_true",
                       help="print one machine-readable JSON object")
        if name == "edit":
            p.add_argument("module", metavar="MODULE", help="e.g. vllm.v1.core.kv_cache_utils")
            p.add_argument("--discard", action="store_true",
                           help="put the pristine file back and end the edit")
        elif name == "create":
            p.add_argument("patch_id", metavar="ID", help="the new patch's id (kebab-case)")
            p.add_argument("--module", help="the edited module (when several are open)")
            p.add_argument("--summary", help="one line: what it changes")
            p.add_argument("--why", help="the bug, and why this fix (the description)")
            p.add_argument("--removal", help="when to delete the patch")
            p.add_argument("--fixed-in", dest="fixed_in", metavar="VERSION",
                           help="the first release with the upstream fix")
            p.add_argument("--from-diff", dest="from_diff", metavar="FILE",
                           help="make the patch from a unified diff (git diff, gh pr diff, a "
                                "GitHub .diff; - for stdin), applied to the installed modules "
                                "with zero fuzz, instead of from an edit")
            p.add_argument("--update", action="store_true",
                           help="finish `vllm-patch update ID` after resolving its conflicts "
                                "(the same as `update ID --continue`)")
        elif name == "update":
            p.add_argument("patch_id", metavar="ID", help="the project patch to update")
            p.add_argument("--continue", dest="resume", action="store_true",
                           help="finish an update whose conflicts were resolved")
            p.add_argument("--base", type=Path, metavar="FILE",
                           help="a pristine copy of the module from the release the patch was "
                                "made on (for a patch made before create kept its base)")
            p.add_argument("--set-fixed-in", dest="set_fixed_in", action="store_true",
                           help="when the installed release already has the patched code, "
                                "record it as the patch's fixed-in")
        elif name == "new":
            p.add_argument("patch_id", metavar="ID", help="the new patch's id (kebab-case)")
            p.add_argument("--target", required=True, metavar="MODULE:SYMBOL",
                           help="e.g. vllm.v1.core.kv_cache_utils:get_kv_cache_groups")
        else:
            p.add_argument("folders", metavar="PATCH_DIR", nargs="*", type=Path,
                           help="patch folders, or folders of them")
    return parser


def _robust_streams() -> None:
    """Any stdout encoding works (an unencodable character is escaped, never an exception)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")


def interrupted_message(written: Sequence[Path], authoring: bool = False) -> str:
    """The one line of a Ctrl-C: what was written before it, or that nothing was."""
    if written:
        files = ", ".join(dict.fromkeys(str(p) for p in written))
        more = " and maybe files of the patch folder" if authoring else ""
        return (f"vllm-patch: interrupted after writing {files}{more} (each file whole: "
                "written atomically); run the command again to finish")
    if authoring:
        return ("vllm-patch: interrupted; any file it wrote is whole (written atomically): "
                "run the command again")
    return "vllm-patch: interrupted; nothing was written"


def main(argv: Sequence[str] | None = None, *, final: bool = False) -> int:
    """The command line. ``final``: the process ends with this call (the console script and
    ``python -m``), so once the work is done Ctrl-C is ignored while the result is printed."""
    written: list[Path] = []
    operation: list[str] = []
    streams = sys.stdout, sys.stderr
    try:
        _robust_streams()
        # Every line this command renders passes one escaping function: control characters
        # from foreign data (a config.json's names, a path) never reach the terminal raw.
        sys.stdout = cast(TextIO, _Escaping(sys.stdout))
        sys.stderr = cast(TextIO, _Escaping(sys.stderr))
        return _main(argv, written, operation, final)
    except BaseException as exc:
        from .__main__ import interrupted

        if not interrupted(exc):  # Ctrl-C, also when a module being loaded wrapped it
            raise
        if final:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        authoring = bool(operation) and operation[0] in _AUTHORING
        print(interrupted_message(written, authoring), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        sys.stdout, sys.stderr = streams


class _Escaping:
    """A text stream that writes through :func:`~.bounded.escape_controls` (JSON output has no
    raw control character to escape: ``json.dumps`` writes them as ``\\u00XX``)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from .bounded import escape_controls

        self._stream.write(escape_controls(text))
        return len(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def _main(argv: Sequence[str] | None, written: list[Path], operation: list[str],
          final: bool) -> int:
    from .models import resolve_model_dir

    arguments = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in arguments[:arguments.index("--")] if "--" in arguments else \
        "--json" in arguments
    command = next((a for a in arguments if not a.startswith("-")), None)
    known = (command if command in _HELP or command in _AUTHORING
             or command in ("doctor", "init") else None)
    finish = partial(_finish, as_json=as_json, final=final)
    try:
        args = _parser(known).parse_args(arguments)
    except _ArgumentError as exc:
        return finish(_Outcome(EXIT_USAGE, failure=_failure(exc)), known)
    operation.append(args.operation)
    if args.operation == "init":
        from ._cli_init import _init

        return _init(args, finish, written)
    found = _project(args)
    if isinstance(found, _Failure):
        return finish(_Outcome(EXIT_USAGE, failure=found), args.operation)
    project, project_rule = found
    if args.operation == "doctor":
        return _doctor(args, project, finish, project_rule)
    try:
        request = Request(
            project_dir=project,
            project_rule=project_rule,
            python=args.python,
            patches=tuple(getattr(args, "patches", ())),
            architectures=tuple(getattr(args, "architectures", ())),
            models=tuple(resolve_model_dir(m, where=f"--model {m}")
                         for m in getattr(args, "models", ())),
            deep=getattr(args, "deep", False),
            strict=getattr(args, "strict", False),
            on_wait=_notice,
            on_write=written.append,
        )
        if args.operation in _AUTHORING:
            try:
                from ._cli_authoring import _author

                return _author(args, request)
            except OSError as exc:  # a file or folder the user cannot use, a full disk
                where = f" {exc.filename}" if exc.filename else ""
                raise TargetEnvironmentError(
                    f"{args.operation} failed on{where}: {exc.strerror or exc}") from None
        report = run(args.operation, request)
    except (ConfigurationError, UsageError, TargetEnvironmentError, CatalogError) as exc:
        failure = _failure(exc)
        return finish(_Outcome(failure.code, failure=failure), args.operation, project=project)
    code = EXIT_OK if report.ok else EXIT_FAILED
    return finish(_Outcome(code, report=report), args.operation,
                  short=getattr(args, "short", False),
                  verbose=args.operation != "status" or args.verbose)



def _project(args: argparse.Namespace) -> tuple[Path, Rule] | _Failure:
    """The project a command runs for (``--project``, else the nearest pyproject.toml from
    the current directory up, else the current directory) and the rule it was admitted by."""
    from .config import find_project_dir
    from .trust import Rule

    if args.project is not None:
        project = args.project.resolve()
        if not project.is_dir():
            return _Failure(EXIT_USAGE, (f"--project {args.project}: not a directory",))
        return project, Rule.CHOSEN
    from .trust import UntrustedPath

    try:
        found = find_project_dir(Path.cwd())
    except UntrustedPath as exc:
        return _Failure(EXIT_USAGE, (f"{exc}; or run in that folder, or name it with "
                                     "--project",))
    return ((found.path, found.rule) if found is not None else (Path.cwd(), Rule.CHOSEN))

# --- init ---------------------------------------------------------------------------------------


def _init_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser("init", help=_INIT, description=_INIT, epilog=_INIT_EPILOG)
    p.add_argument("--project", metavar="DIR", type=Path, default=None,
                   help="the project's folder (default: the current directory; never a "
                        "folder above it)")
    p.add_argument("--model", metavar="DIR", action="append", default=[], dest="models",
                   help="a model folder with config.json that the project serves "
                        "(repeatable): models = [...], relative to the project")
    p.add_argument("--architecture", metavar="NAME", action="append", default=[],
                   dest="architectures",
                   help="a model architecture the project serves (repeatable): "
                        "[tool.vllm-patch.architectures.NAME]")
    p.add_argument("--source", metavar="PATH|GIT-URL",
                   help="where hatch-vllm-patch comes from: a clone or a wheel of it, or a git "
                        "URL (git+https://.../hatch-vllm-patch@<commit>): its "
                        "[tool.uv.sources] entry (with --requirements: the line's direct "
                        "reference)")
    p.add_argument("--requirements", metavar="FILE", type=Path, default=None,
                   help="a pip deployment (requirements file, no project): write only "
                        "[tool.vllm-patch] into the folder's pyproject.toml (made when absent), "
                        "print the line to add to FILE and the commands")
    p.add_argument("--ci", choices=("github",), default=None,
                   help="also write .github/workflows/vllm-patch.yml: install as a fresh clone "
                        "and verify the patches")
    p.add_argument("--docker", action="store_true",
                   help="also write a Dockerfile that installs the project, patches and "
                        "verifies while the image is built")
    p.add_argument("--dry-run", action="store_true",
                   help="print the diffs and the next commands; write nothing")
    p.add_argument("--json", action="store_true",
                   help="print one machine-readable JSON object (result: what was or would "
                        "be written, shape, route, commands)")


# --- doctor -------------------------------------------------------------------------------------


def _doctor_parser(sub: argparse._SubParsersAction[_Parser],
                   where: _Parser) -> None:
    p = sub.add_parser("doctor", parents=[where], help=_DOCTOR, description=_DOCTOR,
                       epilog=_DOCTOR_EPILOG)
    p.add_argument("--model", required=True, metavar="DIR|HUB_ID",
                   help="a model directory with config.json, or a hub id in the local Hugging "
                        "Face cache (HF_HOME / HF_HUB_CACHE); never downloaded")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N")
    p.add_argument("--dtype", default="auto", metavar="DTYPE",
                   help="as vLLM takes it: auto, float32, bfloat16, ... (default auto: vLLM's "
                        "choice for the config's dtype)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                   help="as vLLM takes it: auto, fp8, fp8_e4m3, ... (default auto)")
    p.add_argument("--block-size", type=int, default=None, metavar="TOKENS",
                   help="attention block size (default: the platform's choice)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="as vLLM takes it, e.g. '{\"method\": \"mtp\", "
                        "\"num_speculative_tokens\": 2}' or an EAGLE-3 head "
                        "'{\"method\": \"eagle3\", \"model\": DIR, ...}'")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="KV-cache memory per rank (bytes, or e.g. 8GiB): maximum concurrency "
                        "at --max-model-len")
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="as vLLM takes it (default: a fine-tune's unregistered architecture is "
                        "run as the base architecture its model_type names)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--platform", choices=("cuda", "cpu"), default="cuda",
                   help="whose block-size rules: cuda (vLLM's hybrid alignment with the "
                        "attention backend of --attention-backend on the GPU of --gpu, the "
                        "default) or cpu (vLLM's CPU platform and attention backend)")
    p.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="the attention backend, by vLLM's name (FLASH_ATTN, FLASHINFER, "
                        "TRITON_ATTN, ...; the installed vLLM's names, in any case; auto: "
                        "vLLM's choice): its kernel "
                        "block sizes as its class declares them on the GPU of --gpu (default: "
                        "vLLM's choice on that GPU: FLASH_ATTN, FLASHINFER on Blackwell 10.x)")
    p.add_argument("--gpu", default=None, metavar="NAME|X.Y",
                   help="the GPU the CUDA path models, by name (H100, A100, L40S, B200, ...) or "
                        "compute capability (e.g. 9.0; default H100: Hopper)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="prefix caching on or off (default: vLLM's default, on): doctor then "
                        "says whether a hit reuses the right Mamba state")
    p.add_argument("--mamba-cache-mode", choices=("all", "align", "none"), default=None,
                   help="as vLLM takes it (default: vLLM's choice; \"all\" exists before 0.33)")
    p.add_argument("--mamba-block-size", type=int, default=None, metavar="TOKENS",
                   help="as vLLM takes it (with prefix caching)")
    p.add_argument("--all", action="store_true", dest="all_patches",
                   help="try every patch that applies to this vLLM, also those declared for "
                        "other architectures (default: only the patches for this model)")
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON object")


def doctor_request(args: argparse.Namespace) -> DoctorRequest:
    """doctor's options, checked, as one request (UsageError for a bad value)."""
    from .doctor import DoctorRequest, parse_json_object, parse_memory

    for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size",
                 "max_model_len", "mamba_block_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be 1 or more")
    return DoctorRequest(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        speculative_config=(parse_json_object("--speculative-config", args.speculative_config)
                            if args.speculative_config else None),
        kv_cache_memory=parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None,
        platform=args.platform,
        hf_overrides=(parse_json_object("--hf-overrides", args.hf_overrides)
                      if args.hf_overrides else None),
        trust_remote_code=args.trust_remote_code,
        enable_prefix_caching=args.enable_prefix_caching,
        mamba_cache_mode=args.mamba_cache_mode,
        mamba_block_size=args.mamba_block_size,
        # as vLLM takes it: its enum's name in any case, "auto" for its own choice
        attention_backend=(None if args.attention_backend in (None, "")
                           or args.attention_backend.lower() == "auto"
                           else args.attention_backend.upper()),
        gpu=args.gpu,
    )


def _doctor(args: argparse.Namespace, project: Path, finish: Callable[..., int],
            project_rule: Rule) -> int:
    """``doctor``: text through :func:`.doctor.render.print_report`; ``--json`` and every error
    through :func:`_finish`, in the schema of the other commands (the diagnosis under
    ``result``)."""
    from .doctor import run_doctor
    from .doctor.render import print_report

    try:
        request = doctor_request(args)
        report = run_doctor(request, project_dir=project, python=args.python,
                            project_rule=project_rule,
                            everything=args.all_patches, on_import=lambda: _notice(
                                "doctor: running vLLM's start-up steps in the target "
                                "environment (imports vLLM: about a minute)"))
    except (ConfigurationError, UsageError, InterpreterNotFoundError, UnusableInterpreterError,
            TargetEnvironmentError, CatalogError) as exc:
        failure = _failure(exc)
        return finish(_Outcome(failure.code, failure=failure), "doctor", project=project)
    code = DOCTOR_EXIT[report.outcome]
    if args.json:
        return finish(_Outcome(code, result=report.to_json()), "doctor", project=project)
    _write(lambda: print_report(report, sys.stdout))
    return code


