"""Rendering: the rebinding block ``create`` writes, the wrapper block ``new`` writes, and the
``patch.toml`` of both. Pure text in, text out."""

from __future__ import annotations

import io
import textwrap
import tokenize
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ..catalog import ABSENT, Patch
from .symbols import SymbolChange

PLACEHOLDER = "TODO"


def _snake(patch_id: str) -> str:
    return patch_id.replace("-", "_")


def _indent_code(source: str, extra: str) -> str:
    """``source`` with ``extra`` added before every line that starts code, but not before the
    continuation lines of multi-line strings (their text must not change)."""
    inside: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.end[0] > token.start[0]:  # only a string (or a part of an f-string) spans lines
            inside.update(range(token.start[0] + 1, token.end[0] + 1))
    lines = source.splitlines(keepends=True)
    return "".join(line if (i + 1 in inside or not line.strip()) else extra + line
                   for i, line in enumerate(lines))


def _dedent_code(source: str, extra: str) -> str:
    """The inverse of :func:`_indent_code`: ``extra`` taken off every line that starts code."""
    inside: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.end[0] > token.start[0]:
            inside.update(range(token.start[0] + 1, token.end[0] + 1))
    lines = source.splitlines(keepends=True)
    return "".join(line[len(extra):] if (i + 1 not in inside and line.startswith(extra))
                   else line for i, line in enumerate(lines))


def render_rebinding_block(patch_id: str, module: str, version: str,
                           changes: list[SymbolChange]) -> str:
    """The block that defines exactly the changed and added symbols and rebinds them.

    Functions are defined at module level, which rebinds them. Methods are defined in a class
    named like theirs, nested in a holder class: a class scope is invisible to the functions in
    it, so the methods see the module's names as in the edited file, private names
    (``self.__x``) are mangled with the same class name, and zero-argument ``super()`` is
    pointed at the real class before the methods are set on it. Running the block again
    redefines the same functions: nothing accumulates."""
    snake = _snake(patch_id)
    names = ", ".join(f"{c.symbol}{' (added)' if c.added else ''}" for c in changes)
    head = textwrap.dedent(f"""\
        # Added by hatch-vllm-patch: patch {patch_id}, made by `vllm-patch create` from an edit
        # of {module} ({version}). `vllm-patch revert` removes this block.
        # It redefines: {names}.
        """)
    parts = [head]
    # Module-level statements and functions in the edited file's order (an added constant may
    # hold an added function, a decorator may use an added import).
    for change in sorted((c for c in changes if c.owner is None), key=lambda c: c.line):
        parts.append("\n\n" + change.source.rstrip("\n") + "\n")
    owners: dict[str, list[SymbolChange]] = {}
    for change in changes:
        if change.owner is not None:
            owners.setdefault(change.owner, []).append(change)
    if owners:
        parts.append(textwrap.dedent(f'''\


            def _hvp_{snake}_install(holder, target):
                """Set the methods defined in ``holder`` on ``target``, the class they patch."""
                for name, value in list(vars(holder).items()):
                    if name in ("__module__", "__qualname__", "__dict__", "__weakref__",
                                "__doc__", "__firstlineno__", "__static_attributes__"):
                        continue
                    functions = [getattr(value, "__func__", None),
                                 *(getattr(value, a, None) for a in ("fget", "fset", "fdel"))]
                    if not any(functions):
                        functions = [value]
                    for function in functions:
                        while function is not None:
                            code = getattr(function, "__code__", None)
                            if code is not None and "__class__" in code.co_freevars:
                                cell = function.__closure__[code.co_freevars.index("__class__")]
                                cell.cell_contents = target  # zero-argument super()
                            if code is not None:
                                function.__qualname__ = f"{{target.__qualname__}}.{{name}}"
                            function = getattr(function, "__wrapped__", None)
                    setattr(target, name, value)
            '''))
        for owner, members in owners.items():
            holder = f"_hvp_{snake}_{owner}"
            methods = "\n\n".join(_indent_code(m.source.rstrip("\n") + "\n", "    ")
                                  .rstrip("\n") for m in members)
            parts.append(f"\n\nclass {holder}:\n    class {owner}:\n{methods}\n\n\n"
                         f"_hvp_{snake}_install({holder}.{owner}, {owner})\n")
    return "".join(parts)


# --- the patch folder ---------------------------------------------------------------------------

def _toml_string(value: str) -> str:
    if "\n" in value:
        return '"""\n' + value.replace("\\", "\\\\").replace('"""', '\\"""') + '\n"""'
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_text(value: str) -> str:
    """A prose value: wrapped over lines of at most 96 characters when it is long."""
    if len(value) <= 80 or "\n" in value:
        return _toml_string(value)
    # Break between words only: a hyphenated word ("vllm-patch") or a URL stays whole.
    return _toml_string(textwrap.fill(value, 96, break_on_hyphens=False,
                                      break_long_words=False))


class ManifestTarget(NamedTuple):
    """One target of a manifest: where, the known digests of each symbol it replaces (or
    ``absent``), the module-level names it adds, and (several targets) its block's file."""

    distribution: str
    module: str
    version: str
    shapes: Mapping[str, Sequence[str]]
    adds: tuple[str, ...] = ()
    block: str | None = None


def render_manifest(patch_id: str, *, targets: Sequence[ManifestTarget], summary: str,
                    why: str, removal: str, fixed_in: str | None, made_by: str,
                    links: Sequence[str] = (), architectures: Sequence[str] = (),
                    fixed_shapes: Sequence[str] = (), removed_in: str | None = None) -> str:
    """``patch.toml``: ``[target]`` for one target, ``[[targets]]`` for several."""
    made_on = ", ".join(dict.fromkeys(f"{t.distribution} {t.version}" for t in targets))
    lines = [f"# Made by `vllm-patch {made_by}` on {made_on}."]
    if any(text.startswith(PLACEHOLDER) for text in (summary, why, removal)):
        lines.append("# Fill in the TODOs: they are what `vllm-patch status` shows to whoever "
                     "meets this patch next.")
    lines += [
        f"id = {_toml_string(patch_id)}",
        f"summary = {_toml_string(summary)}",
        f"description = {_toml_text(why)}",
        f"links = [{', '.join(_toml_string(link) for link in links)}]",
        f"removal = {_toml_text(removal)}",
        "# Select it in [tool.vllm-patch] patches = [...] (every model), or list the",
        "# architectures it is for here.",
        f"architectures = [{', '.join(_toml_string(a) for a in architectures)}]",
    ]
    several = len(targets) > 1
    applies = ["[applies]"]
    if fixed_in:
        applies.append(f"fixed-in = {_toml_string(fixed_in)}")
    else:
        applies.append('# fixed-in = "X.Y.Z"  # the first release that has the fix: '
                       "not-needed there")
    if fixed_shapes:
        applies.append("fixed-shapes = [" + ", ".join(map(_toml_string, fixed_shapes)) + "]")
    if removed_in:
        applies.append(f"removed-in = {_toml_string(removed_in)}")
    for target in targets:
        symbols = list(target.shapes)
        lines += ["", "[[targets]]" if several else "[target]",
                  f"distribution = {_toml_string(target.distribution)}",
                  f"module = {_toml_string(target.module)}"]
        if len(symbols) == 1:
            lines.append(f"symbol = {_toml_string(symbols[0])}")
        else:
            lines.append("symbols = [" + ", ".join(_toml_string(s) for s in symbols) + "]")
        if target.adds:
            lines.append("adds = [" + ", ".join(map(_toml_string, target.adds))
                         + "]  # module-level names the block adds")
        lines.append(f"version = {_toml_string(target.version)}  # made on this version")
        if several:
            lines.append(f"block = {_toml_string(target.block or target.module + '.py')}")
        shape_lines = _shape_lines(target.shapes, "targets.shapes" if several else
                                   "applies.shapes")
        if several:
            lines += shape_lines
        else:
            applies += shape_lines
    lines += ["", *applies]
    return "\n".join(lines) + "\n"


def _shape_lines(shapes: Mapping[str, Sequence[str]], table: str) -> list[str]:
    def digests(symbol: str) -> str:
        return "[" + ", ".join(_toml_string(d) for d in shapes[symbol]) + "]"

    symbols = list(shapes)
    if len(symbols) == 1:
        return [f"shapes = {digests(symbols[0])}  # sha256 of the installed code it replaces"]
    return ["", f"[{table}]  # sha256 of the installed code each one replaces "
                f"({ABSENT!r}: added by the patch)",
            *(f"{_toml_string(s)} = {digests(s)}" for s in symbols)]


def render_wrapper_block(patch_id: str, module: str, symbol: str, kind: str,
                         is_async: bool) -> str:
    snake = _snake(patch_id)
    owner, _, name = symbol.rpartition(".")
    current = f"_hvp_{snake}_current"
    function = f"{current}.__func__" if kind != "plain" else current
    if owner:
        lookup = f"vars({owner}).get({name!r})"
        wrapped = f"_hvp_{snake}_wrap({function})"
        install = f"{owner}.{name} = {kind}({wrapped})" if kind != "plain" else \
            f"{owner}.{name} = {wrapped}"
    else:
        lookup = f"globals().get({name!r})"
        install = f"{name} = _hvp_{snake}_wrap({current})"
    define = "async def" if is_async else "def"
    call = "await original(*args, **kwargs)" if is_async else "original(*args, **kwargs)"
    return "\n".join([
        f"# Added by hatch-vllm-patch: patch {patch_id}, a wrapper of {module}.{symbol} made by",
        "# `vllm-patch new`. `vllm-patch revert` removes this block; running it again finds its",
        "# own wrapper and does nothing.",
        "import functools as _hvp_functools",
        "",
        "",
        f"def _hvp_{snake}_wrap(original):",
        f'    """The replacement of {symbol}; ``original`` (also its ``__wrapped__``) is the',
        '    installed one."""',
        "",
        "    @_hvp_functools.wraps(original)",
        f"    {define} {name}(*args, **kwargs):",
        f"        # {PLACEHOLDER}: change the arguments, or the result, here.",
        f"        result = {call}",
        "        return result",
        "",
        f"    {name}._hvp_patch_id = {patch_id!r}",
        f"    return {name}",
        "",
        "",
        f"{current} = {lookup}",
        f"if callable(getattr({current}, '__func__', {current})) and \\",
        f"        getattr({function}, '_hvp_patch_id', None) != {patch_id!r}:",
        f"    {install}",
        f"del {current}",
        "",
    ])



def render_manifest_of(patch: Patch, *, fixed_in: str | None) -> str:
    """The manifest of an existing patch again, with another ``fixed-in``."""
    several = len(patch.parts) > 1
    return render_manifest(
        patch.id, targets=[ManifestTarget(
            m.target.distribution, m.target.module, m.target.version or "unknown",
            {s: sorted(d) for s, d in m.symbol_shapes.items()}, m.target.adds,
            m.block_name if several else None) for m in patch.parts],
        summary=patch.summary, why=patch.description, removal=patch.removal,
        fixed_in=fixed_in, made_by="update", links=patch.links,
        architectures=patch.architectures, fixed_shapes=sorted(patch.fixed_shapes),
        removed_in=patch.removed_in)
