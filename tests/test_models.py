"""models.py: where a hub id's config.json is found in the local Hugging Face cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hatch_vllm_patch.errors import UsageError
from hatch_vllm_patch.models import hub_cache_dir, is_hub_id, model_above, resolve_model_dir


def snapshot(hub: Path, repo: str, commit: str, ref: str | None = None) -> Path:
    folder = hub / f"models--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    if ref is not None:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.mark.parametrize("text, expected", [
    ("Qwen/Qwen3.6-35B-A3B", True), ("Org/Name@v1.0", True), ("./Org/Name", False),
    ("/abs/Org/Name", False), ("name", False), ("a/b/c", False), ("../x", False),
    ("Org/..", False),
])
def test_is_hub_id(text: str, expected: bool) -> None:
    """Org/Name (optionally @revision) is a hub id; paths are not."""
    assert is_hub_id(text) is expected


def test_hub_cache_dir_order(tmp_path: Path) -> None:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache."""
    assert hub_cache_dir({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}) == Path("/c")
    assert hub_cache_dir({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}) == Path("/h/hub")
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({}) == Path(os.path.expanduser("~/.cache/huggingface/hub"))


def test_resolve_model_dir_follows_refs_and_revisions(tmp_path: Path) -> None:
    """refs/main names the snapshot; @branch follows its ref, @commit names the snapshot; with
    no ref the newest snapshot holding a config.json is taken."""
    env = {"HF_HUB_CACHE": str(tmp_path)}
    main = snapshot(tmp_path, "Acme/M", "aaa", "main")
    dev = snapshot(tmp_path, "Acme/M", "bbb", "dev")
    assert resolve_model_dir("Acme/M", tmp_path, environ=env) == main
    assert resolve_model_dir("Acme/M@dev", tmp_path, environ=env) == dev
    assert resolve_model_dir("Acme/M@bbb", tmp_path, environ=env) == dev
    old = snapshot(tmp_path, "Acme/N", "old")
    new = snapshot(tmp_path, "Acme/N", "new")
    os.utime(old, (1, 1))
    assert resolve_model_dir("Acme/N", tmp_path, environ=env) == new


def test_resolve_model_dir_paths_and_misses(tmp_path: Path) -> None:
    """A path is returned resolved (read_model judges it); an uncached id is a UsageError
    naming the place looked in."""
    assert resolve_model_dir("./m", tmp_path, environ={}) == (tmp_path / "m").resolve()
    with pytest.raises(UsageError, match=r"looked for .*models--Acme--Gone/snapshots/\*/"
                                         r"config\.json") as info:
        resolve_model_dir("Acme/Gone", tmp_path, where="--model Acme/Gone",
                          environ={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert str(info.value).startswith("--model Acme/Gone: 'Acme/Gone' is not a directory")


def test_relative_model_path_from_a_subfolder(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`models/x` typed in a subfolder of the project is named as the path it is (`../models/x`),
    not sent to the hub cache with an `hf download` hint."""
    (tmp_path / ".git").mkdir()
    (tmp_path / "models" / "x").mkdir(parents=True)
    (tmp_path / "models" / "x" / "config.json").write_text("{}")
    sub = tmp_path / "service"
    sub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UsageError) as info:
        resolve_model_dir("models/x", sub, where="--model models/x")
    assert "../models/x is a model directory" in str(info.value)
    assert "hf download" not in str(info.value)
    assert model_above("models/x", sub) == "../models/x"
    assert model_above("models/y", sub) is None
    assert resolve_model_dir("models/x", tmp_path) == (tmp_path / "models" / "x").resolve()
