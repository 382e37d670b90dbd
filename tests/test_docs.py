"""The docs site: generated reference pages are current, marked console examples print what they
show, the site builds strictly with a search index, and the README stays a landing page."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO
from support.console_examples import SHOWN_REPO, SHOWN_WORKDIR, commands
from support.venvs import scrubbed_environ

from hatch_vllm_patch import _docs, config

DOCS = REPO / "docs"
EXAMPLE = re.compile(r"<!-- example: (?P<setup>[\w-]+) -->\n```console\n(?P<body>.*?)\n```",
                     re.S)
BAD_CONFIG = """\
[project]
name = "demo"
version = "0"

[tool.vllm-patch]
patches = ["kv-cache"]
guard = "loud"
"""


BAD_PATCH = """\
id = "my-fix"
summary = "a clearer message"
symbol = "x"

[target]
distribution = "vllm"
module = "vllm.v1.core.kv_cache_utils"
symbol = "get_kv_cache_groups"
"""


def test_generated_pages_are_current() -> None:
    """Every generated reference page (and the catalog's navigation) equals what the code gives."""
    stale = [str(p.relative_to(REPO)) for p in _docs.stale()]
    assert not stale, f"stale generated docs: {stale}; regenerate with: {_docs.REGENERATE}"


def test_generator_refuses_an_undescribed_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A [tool.vllm-patch] key the generator has no description of fails generation."""
    monkeypatch.setattr(config, "_TOP_KEYS", {*config._TOP_KEYS, "new-key"})
    with pytest.raises(_docs.StaleError, match="new-key"):
        _docs.configuration_page()


def test_reference_names_everything() -> None:
    """The CLI page names every command and option, the config page every key, the catalog
    every patch."""
    cli_page = (DOCS / "reference" / "cli.md").read_text()
    parser = _docs._cli._parser()
    for name, sub in _docs._subparsers(parser).items():
        assert f"## {name}\n" in cli_page
        for action in sub._actions:
            for flag in action.option_strings:
                assert f"`{flag}" in cli_page, (name, flag)
    conf = (DOCS / "reference" / "configuration.md").read_text()
    for key in config._TOP_KEYS | config._ARCH_KEYS:
        assert f"`{key}`" in conf
    patches = sorted(p.name for p in (REPO / "patches").iterdir() if (p / "patch.toml").is_file())
    assert patches, "no catalog patches found"
    for patch_id in patches:
        assert (DOCS / "reference" / "catalog" / f"{patch_id}.md").is_file()


# docs/how-to/install.md's `vllm-patch init` example
HATCHLING_PROJECT = """\
[project]
name = "my-service"
version = "0.1.0"
requires-python = ">=3.11"
dependencies = ["vllm==0.20.2"]

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"
"""


def _examples() -> list[tuple[str, str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for m in EXAMPLE.finditer(page.read_text(encoding="utf-8")):
            found.append((str(page.relative_to(DOCS)), m["setup"], m["body"]))
    return found


EXAMPLES = _examples()


def test_examples_are_found() -> None:
    """The example marker matches blocks (a broken pattern cannot pass silently)."""
    assert len(EXAMPLES) >= 3, EXAMPLES


@pytest.mark.parametrize(("page", "setup", "body"), EXAMPLES,
                         ids=[f"{p}:{s}:{i}" for i, (p, s, _) in enumerate(EXAMPLES)])
def test_console_example(page: str, setup: str, body: str, tmp_path: Path) -> None:
    """A marked console example prints what the page shows (paths as shown)."""
    work = tmp_path / "demo"
    (work / ".git").mkdir(parents=True)  # the project search stops here
    if setup == "bad-config":
        (work / "pyproject.toml").write_text(BAD_CONFIG)
    elif setup == "bad-patch":
        folder = work / "vllm-patches" / "my-fix"
        folder.mkdir(parents=True)
        (folder / "patch.toml").write_text(BAD_PATCH)
        (folder / "block.py").write_text("def get_kv_cache_groups(:\n")
    elif setup in ("hatchling-project", "set-up-project", "pip-deployment"):
        shutil.copytree(REPO / "tests" / "fixtures" / "doctor" / "granite-4.0-h-tiny",
                        work / "models" / "granite-4.0-h-tiny")
        if setup == "pip-deployment":
            (work / "requirements.txt").write_text("vllm==0.20.2\n")
        else:
            (work / "pyproject.toml").write_text(HATCHLING_PROJECT)
        if setup == "set-up-project":  # as `vllm-patch init --model ...` left it
            subprocess.run([sys.executable, "-I", "-m", "hatch_vllm_patch", "init", "--model",
                            "models/granite-4.0-h-tiny"], cwd=work, check=True,
                           capture_output=True, env=scrubbed_environ())
    else:
        assert setup == "empty", f"{page}: unknown example setup {setup!r}"
    env = {**scrubbed_environ(), "COLUMNS": "80", "NO_COLOR": "1"}
    for cmd, shown in commands(body):
        argv = shlex.split(cmd.replace(SHOWN_REPO, str(REPO)))
        assert argv[0] == "vllm-patch", f"{page}: only vllm-patch examples run: {cmd}"
        proc = subprocess.run([sys.executable, "-I", "-m", "hatch_vllm_patch", *argv[1:]],
                              cwd=work, env=env, capture_output=True, text=True, timeout=120)
        got = (proc.stdout + proc.stderr).replace(str(work.resolve()), SHOWN_WORKDIR)
        got = got.replace(str(REPO), SHOWN_REPO)
        got = "\n".join(line.rstrip() for line in got.strip().splitlines())
        assert got == shown.strip(), (f"{page}: `{cmd}` printed something else; update the page "
                                      f"or the code:\n{got}")


def test_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict` succeeds (no warning: no broken link or anchor) and writes a
    search index that finds every command and catalog patch."""
    site = tmp_path / "site"
    env = {**scrubbed_environ(), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    index = json.loads((site / "search" / "search_index.json").read_text())
    text = json.dumps(index)
    assert len({d["location"].split("#")[0] for d in index["docs"]}) >= 8
    for patch_id in (p.name for p in (REPO / "patches").iterdir()):
        assert patch_id in text
    assert (site / "index.html").is_file()


def test_readme_is_a_landing_page() -> None:
    """README.md stays under 12,000 bytes, keeps the quick start and names the docs commands."""
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) <= 12_000, len(readme)
    text = readme.decode()
    for line in ("$ uv run --directory example_project vllm-patch verify --deep",
                 "$ uv run pytest", "uv run mkdocs serve", "uv run mkdocs build --strict"):
        assert line in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / link).is_file(), link


def test_help_names_the_docs() -> None:
    """`vllm-patch --help` points at the docs."""
    proc = subprocess.run([sys.executable, "-I", "-m", "hatch_vllm_patch", "--help"],
                          env={**os.environ, "COLUMNS": "80"}, capture_output=True, text=True)
    assert "docs/reference/cli.md" in proc.stdout


def test_check_names_a_stale_page(tmp_path: Path) -> None:
    """`--check` finds a hand-edited generated page and a catalog page whose patch is gone."""
    import shutil

    for name in ("docs", "patches"):
        shutil.copytree(REPO / name, tmp_path / name)
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    assert _docs.stale(tmp_path) == []
    cli_page = tmp_path / "docs" / "reference" / "cli.md"
    cli_page.write_text(cli_page.read_text() + "edited by hand\n")
    (tmp_path / "docs" / "reference" / "catalog" / "gone.md").write_text("# gone\n")
    assert _docs.stale(tmp_path) == [cli_page,
                                     tmp_path / "docs" / "reference" / "catalog" / "gone.md"]
