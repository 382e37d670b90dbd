"""Every file written outside site-packages (and in it) is created exclusively: a new file of a
random name in the target's folder, opened with ``O_CREAT | O_EXCL | O_NOFOLLOW``, then
renamed. A symlink planted under a temporary name used before, or under a guessed one, is never
written through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from support.commands import cli
from support.demo import DEMO_SOURCE
from support.venvs import create_venv, site_packages

from hatch_vllm_patch.files import TEMP_SUFFIX, create_exclusive, write_atomic

SECRET = b"root only\n"


def plant(folder: Path, names: list[str], secret: Path) -> list[Path]:
    """Symlinks to ``secret`` under ``names`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    links = []
    for name in names:
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(secret)
        links.append(link)
    return links


def temp_names(target: str) -> list[str]:
    """The fixed temp names used before for ``target``, and guessed random-looking ones."""
    return [f".{target}{TEMP_SUFFIX}", f".{target}.tmp", f".{target}.0000000000000000{TEMP_SUFFIX}",
            f".{target}.abcdefgh{TEMP_SUFFIX}"]


def test_write_atomic_never_follows_a_planted_name(tmp_path: Path) -> None:
    """write_atomic creates its temp file exclusively: symlinks planted under the names around it
    stay untouched, the target becomes a regular file and no temp file is left."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    folder = tmp_path / "out"
    plant(folder, temp_names("patch.toml"), secret)
    target = folder / "patch.toml"
    write_atomic(target, "x = 1\n")
    write_atomic(target, b"x = 2\n")
    assert secret.read_bytes() == SECRET and target.read_text() == "x = 2\n"
    assert stat.S_ISREG(os.lstat(target).st_mode)
    fd, name = create_exclusive(folder, "patch.toml")
    os.close(fd)
    assert stat.S_IMODE(os.stat(name).st_mode) == 0o600 and name.endswith(TEMP_SUFFIX)
    os.unlink(name)
    assert sorted(p.name for p in folder.iterdir() if not p.is_symlink()) == ["patch.toml"]


def test_authoring_and_the_record_write_through_no_planted_symlink(
        tmp_path: Path, demo_wheels: dict[str, Path]) -> None:
    """create, new, apply (the record) and update --set-fixed-in, with symlinks to a 0600 file
    planted at every temp name used before and at guessed ones beside each file they write:
    the file is unchanged, patch.toml stays a regular file, and the commands work."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    python = create_venv(tmp_path / "v1", str(demo_wheels["1.0.0"]))
    fixed = create_venv(tmp_path / "v2", str(demo_wheels["2.0.0"]))
    site = site_packages(tmp_path / "v1")
    core = site / "demo_pkg" / "core.py"
    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "0"\n\n'
                                            "[tool.vllm-patch]\n")
    patches = project / "vllm-patches"
    links = plant(patches, [*temp_names("zero-fix"), *temp_names("wrap-fix")], secret)
    links += plant(site, [*temp_names(".hatch-vllm-patch.json"),
                          *temp_names("hatch-vllm-patch.json")], secret)
    links += plant(core.parent, temp_names("core.py"), secret)
    links += plant(project, temp_names("pyproject.toml"), secret)

    def ok(*args: str) -> None:
        proc = cli(*args, "--python", str(python), cwd=project)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    ok("edit", "demo_pkg.core")
    core.write_text(DEMO_SOURCE.replace('raise NotImplementedError("empty")', "return 0"))
    ok("create", "zero-fix", "--summary", "Zero for nothing")
    folder = patches / "zero-fix"
    links += plant(folder, temp_names("patch.toml"), secret)
    links += plant(patches, [".zero-fix.old.hvp-tmp", ".zero-fix.hvp-tmp"], secret)
    ok("new", "wrap-fix", "--target", "demo_pkg.core:other")
    links += plant(patches / "wrap-fix", temp_names("patch.toml"), secret)
    (project / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "0"\n\n'
                                            '[tool.vllm-patch]\npatches = ["zero-fix"]\n')
    ok("apply")
    assert (site / ".hatch-vllm-patch.json").is_file()
    assert not (site / ".hatch-vllm-patch.json").is_symlink()
    updated = cli("update", "zero-fix", "--set-fixed-in", "--python", str(fixed), cwd=project)
    assert updated.returncode == 0, updated.stdout + updated.stderr
    manifest = folder / "patch.toml"
    assert stat.S_ISREG(os.lstat(manifest).st_mode), "patch.toml became a link"
    assert 'fixed-in = "2.0.0"' in manifest.read_text()
    assert secret.read_bytes() == SECRET and stat.S_IMODE(secret.stat().st_mode) == 0o600
    for link in links:  # each planted link is gone (a stale temp name) or still the link
        assert not link.exists() or link.is_symlink(), link
