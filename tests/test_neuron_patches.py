"""The vllm-neuron patches (neuron-runner-kv-spec, neuron-platform-prefix-caching).

Fast tests: the structural shape checks on our stand-in plugins and on small sources, and the
appended blocks' logic on stand-in classes. Slow tests: the real vllm==0.16.0 on CPU in a venv,
our stand-in plugins (tests/fixtures/neuron, written for these tests) installed as real
distributions, the patches applied with the CLI, and tests/fixtures/neuron/scenarios.py driving
vLLM's real config validation and KV-cache grouping before and after.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.commands import cli
from support.venvs import UV, create_venv, run, site_packages, vllm_venv

from hatch_vllm_patch.catalog import load_catalog

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "neuron"
RUNNER_ID = "neuron-runner-kv-spec"
PLATFORM_ID = "neuron-platform-prefix-caching"
RUNNER_FILE = "vllm_neuron/worker/neuronx_distributed_model_runner.py"
PLATFORM_FILE = "vllm_neuron/platform.py"
VARIANTS = ("per_layer", "per_layer_unguarded", "aggregated", "mamba_state")

# scenarios.py: 8 layers, full attention every 4th (layers 3 and 7), 2 KV heads of 64, bf16,
# max_model_len 1024 = block_size (the plugin's contiguous layout), 64 MiB for the KV cache.
HYBRID_CASES = [f"{m}/tp{tp}" for m in ("qwen3_next_tiny", "qwen3_5_like_tiny") for tp in (1, 8)]
LLAMA_CASES = ["llama_tiny/tp1", "llama_tiny/tp8"]
FULL_ATTENTION_LAYERS = ["layers.3.self_attn", "layers.7.self_attn"]
# 64 MiB / (layers * 2 (K, V) * KV heads per rank * 64 * 2 B * 1024 tokens); TP 8 keeps 1 head.
CONCURRENCY_ALL_LAYERS = {"tp1": 16.0, "tp8": 32.0}
CONCURRENCY_FULL_ATTENTION = {"tp1": 64.0, "tp8": 128.0}
HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2

assert all((FIXTURES / v / "pyproject.toml").is_file() for v in VARIANTS), "fixtures missing"


def load_classifier(patch_id: str) -> Callable[[str], tuple[str, str]]:
    spec = importlib.util.spec_from_file_location(f"classify_{patch_id}", PATCHES / patch_id /
                                                  "classify.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.classify  # type: ignore[no-any-return]


# --- shape checks -------------------------------------------------------------------------------

@pytest.mark.parametrize(("variant", "expected"), [
    ("per_layer", "known"),
    ("per_layer_unguarded", "known"),
    ("mamba_state", "known"),
    ("aggregated", "not-applicable"),
])
def test_runner_shape_of_each_stand_in_plugin(variant: str, expected: str) -> None:
    """Per-layer runners are known; the aggregated "layer" runner is not applicable, with why."""
    verdict, reason = load_classifier(RUNNER_ID)((FIXTURES / variant / RUNNER_FILE).read_text())
    assert (verdict, bool(reason)) == (expected, True), reason
    if expected == "not-applicable":
        assert "aggregated 'layer' entry" in reason


@pytest.mark.parametrize(("variant", "guard"), [
    ("per_layer", "with"),
    ("aggregated", "with"),
    ("mamba_state", "with"),
    ("per_layer_unguarded", "without"),
])
def test_platform_shape_of_each_stand_in_plugin(variant: str, guard: str) -> None:
    """Every stand-in platform hook is known, with or without the model_config-is-None return."""
    verdict, reason = load_classifier(PLATFORM_ID)((FIXTURES / variant / PLATFORM_FILE).read_text())
    assert verdict == "known", reason
    assert f"({guard} the early return" in reason


RUNNER_SOURCES = {
    "no class": ("unknown", "class Other:\n    def get_kv_cache_spec(self):\n        return {}\n"),
    "class only nested": ("unknown", "def f():\n" + textwrap.indent(
        "class NeuronxDistributedModelRunner:\n    def get_kv_cache_spec(self):\n"
        "        return {}\n", "    ")),
    "no method": ("unknown", "class NeuronxDistributedModelRunner:\n    def other(self):\n"
                             "        return {}\n"),
    "extra parameter": ("unknown", "class NeuronxDistributedModelRunner:\n"
                                   "    def get_kv_cache_spec(self, layer):\n        return {}\n"),
    "property": ("unknown", "class NeuronxDistributedModelRunner:\n    @property\n"
                            "    def get_kv_cache_spec(self):\n        return {}\n"),
    "syntax error": ("unknown", "class NeuronxDistributedModelRunner(:\n"),
    "aggregated in one branch only": ("known", "class NeuronxDistributedModelRunner:\n"
                                               "    def get_kv_cache_spec(self):\n"
                                               "        if self.flat:\n"
                                               "            return {'layer': 1}\n"
                                               "        return {'layers.0.self_attn': 1}\n"),
}


@pytest.mark.parametrize("case", sorted(RUNNER_SOURCES))
def test_runner_shape_of_small_sources(case: str) -> None:
    """The runner check needs the class at module level and get_kv_cache_spec(self), undecorated."""
    expected, source = RUNNER_SOURCES[case]
    verdict, reason = load_classifier(RUNNER_ID)(source)
    assert verdict == expected, reason


PLATFORM_SOURCES = {
    "no class": "class Other:\n    @classmethod\n    def check_and_update_config(cls, c):\n"
                "        pass\n",
    "no method": "class NeuronPlatform:\n    @classmethod\n    def other(cls, c):\n        pass\n",
    "plain method": "class NeuronPlatform:\n    def check_and_update_config(self, c):\n"
                    "        pass\n",
    "staticmethod": "class NeuronPlatform:\n    @staticmethod\n"
                    "    def check_and_update_config(c):\n        pass\n",
    "extra parameter": "class NeuronPlatform:\n    @classmethod\n"
                       "    def check_and_update_config(cls, c, d):\n        pass\n",
    "syntax error": "class NeuronPlatform(:\n",
}


@pytest.mark.parametrize("case", sorted(PLATFORM_SOURCES))
def test_platform_shape_of_small_sources(case: str) -> None:
    """Anything but a module-level classmethod check_and_update_config(cls, config) is unknown."""
    verdict, reason = load_classifier(PLATFORM_ID)(PLATFORM_SOURCES[case])
    assert verdict == "unknown" and reason


def test_patch_folders_load_as_catalog_entries(tmp_path: Path) -> None:
    """Both folders load through the real catalog: optional vllm-neuron targets, checks, probes."""
    for patch_id in (RUNNER_ID, PLATFORM_ID):
        shutil.copytree(PATCHES / patch_id, tmp_path / patch_id)
    catalog = load_catalog(tmp_path)
    expected = {
        RUNNER_ID: ("vllm_neuron.worker.neuronx_distributed_model_runner",
                    "NeuronxDistributedModelRunner.get_kv_cache_spec"),
        PLATFORM_ID: ("vllm_neuron.platform", "NeuronPlatform.check_and_update_config"),
    }
    for patch_id, (module, symbol) in expected.items():
        patch = catalog[patch_id]
        assert (patch.target.distribution, patch.target.module, patch.target.symbol,
                patch.target.optional) == ("vllm-neuron", module, symbol, True)
        assert patch.classifier_path is not None and patch.probe_path is not None
        assert "Qwen3NextForCausalLM" in patch.architectures
        assert patch.block.endswith("\n")


# --- the blocks on stand-in classes (no vLLM) ----------------------------------------------------

def exec_block(patch_id: str, namespace: dict[str, Any]) -> dict[str, Any]:
    source = (PATCHES / patch_id / "block.py").read_text()
    exec(compile(source, f"{patch_id}/block.py", "exec"), namespace)
    return namespace


def text_model(layer_types: list[str] | None) -> SimpleNamespace:
    """A text-only model config as vLLM holds it: hf_text_config is hf_config."""
    hf = SimpleNamespace() if layer_types is None else SimpleNamespace(layer_types=layer_types)
    return SimpleNamespace(hf_config=hf, hf_text_config=hf, max_model_len=1024,
                           architecture="TestForCausalLM")


def nested_model(layer_types: list[str], *, with_text_config_attr: bool) -> SimpleNamespace:
    """A Qwen3.5-like config: layer_types only in text_config."""
    text = SimpleNamespace(layer_types=layer_types)
    model = SimpleNamespace(hf_config=SimpleNamespace(text_config=text), max_model_len=1024,
                            architecture="TestForConditionalGeneration")
    if with_text_config_attr:
        model.hf_text_config = text
    return model


def runner_class() -> dict[str, Any]:
    class NeuronxDistributedModelRunner:
        def __init__(self, spec: dict[str, object], **attributes: Any) -> None:
            self.spec = spec
            self.calls = 0
            vars(self).update(attributes)

        def get_kv_cache_spec(self) -> dict[str, object]:
            self.calls += 1
            return self.spec

    return {"__name__": "hvp_test_runner",
            "NeuronxDistributedModelRunner": NeuronxDistributedModelRunner}


def per_layer_spec(layer_types: list[str]) -> dict[str, object]:
    return {f"layers.{i}.{'linear' if t == 'linear_attention' else 'self'}_attn": object()
            for i, t in enumerate(layer_types)}


@pytest.mark.parametrize("where", ["top level", "text_config via hf_text_config",
                                   "text_config only", "vllm_config.model_config"])
def test_runner_block_leaves_out_linear_attention_entries(where: str) -> None:
    """For a hybrid config (wherever layer_types live) only the full-attention entries remain."""
    cls = exec_block(RUNNER_ID, runner_class())["NeuronxDistributedModelRunner"]
    spec = per_layer_spec(HYBRID)
    model = {
        "top level": text_model(HYBRID),
        "text_config via hf_text_config": nested_model(HYBRID, with_text_config_attr=True),
        "text_config only": nested_model(HYBRID, with_text_config_attr=False),
        "vllm_config.model_config": text_model(HYBRID),
    }[where]
    if where == "vllm_config.model_config":
        runner = cls(spec, vllm_config=SimpleNamespace(model_config=model))
    else:
        runner = cls(spec, model_config=model)
    result = runner.get_kv_cache_spec()
    assert list(result) == FULL_ATTENTION_LAYERS
    assert all(result[name] is spec[name] for name in result)
    assert runner.calls == 1 and len(spec) == 8  # the original ran once; its dict is not mutated


@pytest.mark.parametrize("case", ["llama", "sliding window", "hf_text_config wins",
                                  "aggregated", "already without linear layers"])
def test_runner_block_returns_the_original_object(case: str) -> None:
    """Without linear-attention entries to leave out, the original method's object comes back."""
    cls = exec_block(RUNNER_ID, runner_class())["NeuronxDistributedModelRunner"]
    full = ["full_attention"] * 8
    model, spec = {
        "llama": (text_model(None), per_layer_spec(full)),
        "sliding window": (text_model(["sliding_attention", "full_attention"] * 4),
                           per_layer_spec(full)),
        "hf_text_config wins": (
            SimpleNamespace(hf_text_config=SimpleNamespace(layer_types=full),
                            hf_config=SimpleNamespace(layer_types=HYBRID)),
            per_layer_spec(full)),
        "aggregated": (text_model(HYBRID), {"layer": object()}),
        "already without linear layers": (
            text_model(HYBRID), {name: object() for name in FULL_ATTENTION_LAYERS}),
    }[case]
    assert cls(spec, model_config=model).get_kv_cache_spec() is spec


def test_runner_block_keeps_a_spec_of_only_linear_layers(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """A spec that would become empty is returned unchanged, with a warning."""
    cls = exec_block(RUNNER_ID, runner_class())["NeuronxDistributedModelRunner"]
    spec = {"layers.0.linear_attn": object(), "layers.1.linear_attn": object()}
    model = text_model(["linear_attention", "linear_attention"])
    with caplog.at_level(logging.WARNING, logger="hvp_test_runner"):
        assert cls(spec, model_config=model).get_kv_cache_spec() is spec
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_runner_block_wraps_once_when_run_twice() -> None:
    """Executing the block again on the same class keeps exactly one wrapper."""
    namespace = runner_class()
    original = namespace["NeuronxDistributedModelRunner"].__dict__["get_kv_cache_spec"]
    exec_block(RUNNER_ID, exec_block(RUNNER_ID, namespace))
    method = namespace["NeuronxDistributedModelRunner"].__dict__["get_kv_cache_spec"]
    assert method._hvp_patch_id == RUNNER_ID and method.__wrapped__ is original


def platform_class() -> dict[str, Any]:
    class NeuronPlatform:
        seen: list[tuple[type, object]] = []  # noqa: RUF012

        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            cache = getattr(vllm_config, "cache_config", None)
            cls.seen.append((cls, getattr(cache, "enable_prefix_caching", None)))
            if vllm_config.model_config is None:
                return
            if not cache.enable_prefix_caching:
                cache.block_size = vllm_config.model_config.max_model_len

    return {"__name__": "hvp_test_platform", "NeuronPlatform": NeuronPlatform}


def vllm_config(model: Any, **cache: Any) -> SimpleNamespace:
    fields = {"enable_prefix_caching": True, "block_size": 16, "mamba_cache_mode": "align",
              "mamba_block_size": 160, **cache}
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(**fields))


@pytest.mark.parametrize("nested", [False, True])
def test_platform_block_turns_prefix_caching_off_before_the_original(
        nested: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Hybrid: prefix caching and the fields derived from it are reset, then the original runs."""
    platform = exec_block(PLATFORM_ID, platform_class())["NeuronPlatform"]
    model = nested_model(HYBRID, with_text_config_attr=False) if nested else text_model(HYBRID)
    config = vllm_config(model)
    with caplog.at_level(logging.WARNING, logger="hvp_test_platform"):
        platform.check_and_update_config(config)
        platform.check_and_update_config(config)  # vLLM may call the hook again: no new warning
    assert platform.seen == [(platform, False), (platform, False)]
    assert vars(config.cache_config) == {"enable_prefix_caching": False, "block_size": 1024,
                                         "mamba_cache_mode": "none", "mamba_block_size": 1024}
    assert len(caplog.records) == 1 and PLATFORM_ID in caplog.records[0].getMessage()


def test_platform_block_keeps_classmethod_semantics() -> None:
    """The wrapper stays a classmethod: called on a subclass or an instance, cls is the subclass."""
    platform = exec_block(PLATFORM_ID, platform_class())["NeuronPlatform"]
    assert isinstance(platform.__dict__["check_and_update_config"], classmethod)
    sub = type("SubPlatform", (platform,), {})
    sub.check_and_update_config(vllm_config(None))
    sub().check_and_update_config(vllm_config(None))
    assert [cls for cls, _ in platform.seen] == [sub, sub]


@pytest.mark.parametrize("case", ["no model", "non-hybrid", "prefix caching off",
                                  "vLLM without mamba fields"])
def test_platform_block_leaves_other_configs_to_the_original(case: str) -> None:
    """No model, no linear layers or prefix caching already off: the original alone decides."""
    platform = exec_block(PLATFORM_ID, platform_class())["NeuronPlatform"]
    if case == "vLLM without mamba fields":
        config = vllm_config(text_model(HYBRID))
        del config.cache_config.mamba_cache_mode, config.cache_config.mamba_block_size
        platform.check_and_update_config(config)
        assert vars(config.cache_config) == {"enable_prefix_caching": False, "block_size": 1024}
        return
    config = {
        "no model": vllm_config(None),
        "non-hybrid": vllm_config(text_model(["full_attention"] * 8)),
        "prefix caching off": vllm_config(text_model(HYBRID), enable_prefix_caching=False,
                                          mamba_cache_mode="none", mamba_block_size=1024),
    }[case]
    expected = dict(vars(config.cache_config))
    platform.check_and_update_config(config)
    if case == "prefix caching off":
        expected["block_size"] = 1024  # the original's own contiguous layout
    assert vars(config.cache_config) == expected
    assert len(platform.seen) == 1


def test_platform_block_wraps_once_when_run_twice() -> None:
    """Executing the block again on the same class keeps exactly one classmethod wrapper."""
    namespace = platform_class()
    original = namespace["NeuronPlatform"].__dict__["check_and_update_config"].__func__
    exec_block(PLATFORM_ID, exec_block(PLATFORM_ID, namespace))
    function = namespace["NeuronPlatform"].__dict__["check_and_update_config"].__func__
    assert function._hvp_patch_id == PLATFORM_ID and function.__wrapped__ is original


def test_absent_plugin_is_not_installed(tmp_path: Path) -> None:
    """Without vllm-neuron in the target environment both optional patches are not-installed."""
    python = create_venv(tmp_path / "bare")
    result = patch_cli(python, copy_catalog(tmp_path / "catalog"), "apply")
    assert result["exit"] == 0
    assert verdicts(result) == {RUNNER_ID: "not-installed", PLATFORM_ID: "not-installed"}


# --- end to end with real vLLM 0.16.0 -----------------------------------------------------------

def copy_catalog(root: Path) -> Path:
    for patch_id in (RUNNER_ID, PLATFORM_ID):
        shutil.copytree(PATCHES / patch_id, root / patch_id)
    return root


def patch_cli(python: Path, catalog: Path, operation: str, *extra: str) -> dict[str, Any]:
    proc = cli(operation, "--python", str(python), "--patch", RUNNER_ID, "--patch", PLATFORM_ID,
               "--json", *extra, catalog=catalog)
    data: dict[str, Any] = json.loads(proc.stdout)
    data["exit"] = proc.returncode
    return data


def verdicts(result: dict[str, Any]) -> dict[str, str]:
    return {p["id"]: p["verdict"] for p in result["patches"]}


def install_plugin(python: Path, variant: str, workdir: Path, *, editable: bool) -> Path:
    """Install a copy of a stand-in plugin (a copy: patching an editable install edits its
    checkout, and builds leave files in the source tree); return the copy."""
    source = workdir / variant
    shutil.copytree(FIXTURES / variant, source)
    run([UV, "pip", "install", "--quiet", "--python", str(python),
         *(["-e", str(source)] if editable else [str(source)])])
    return source


def run_scenarios(python: Path, report: Path) -> dict[str, Any]:
    run([str(python), str(FIXTURES / "scenarios.py"), str(FIXTURES / "models"), str(report)],
        env={"HF_HUB_OFFLINE": "1"}, timeout=1200)
    data: dict[str, Any] = json.loads(report.read_text())
    return data


@pytest.fixture(scope="module")
def vllm_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the full real vllm==0.16.0; each flow below installs its own plugin into it."""
    return vllm_venv(tmp_path_factory.mktemp("neuron-vllm") / "venv", "0.16.0")


@pytest.fixture(scope="module")
def per_layer_flow(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> dict[str, Any]:
    """Editable hatchling plugin, per-layer runner: before, apply, after, deep verify, revert."""
    work = tmp_path_factory.mktemp("per-layer")
    checkout = install_plugin(vllm_python, "per_layer", work, editable=True)
    originals = {rel: (checkout / rel).read_bytes() for rel in (RUNNER_FILE, PLATFORM_FILE)}
    catalog = copy_catalog(work / "catalog")
    flow: dict[str, Any] = {"checkout": checkout}
    flow["before"] = run_scenarios(vllm_python, work / "before.json")
    flow["apply"] = patch_cli(vllm_python, catalog, "apply")
    flow["after"] = run_scenarios(vllm_python, work / "after.json")
    flow["deep"] = patch_cli(vllm_python, catalog, "verify", "--deep")
    flow["revert"] = patch_cli(vllm_python, catalog, "revert")
    flow["restored"] = {rel: (checkout / rel).read_bytes() == data
                        for rel, data in originals.items()}
    flow["verify_reverted"] = patch_cli(vllm_python, catalog, "verify")
    return flow


@pytest.fixture(scope="module")
def unguarded_flow(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> dict[str, Any]:
    """Non-editable setuptools plugin without the model_config-is-None return: apply, after."""
    work = tmp_path_factory.mktemp("unguarded")
    install_plugin(vllm_python, "per_layer_unguarded", work, editable=False)
    catalog = copy_catalog(work / "catalog")
    flow = {"apply": patch_cli(vllm_python, catalog, "apply")}
    flow["after"] = run_scenarios(vllm_python, work / "after.json")
    flow["revert"] = patch_cli(vllm_python, catalog, "revert")
    installed = site_packages(vllm_python.parent.parent)
    flow["restored"] = {
        rel: (installed / rel).read_bytes() == (FIXTURES / "per_layer_unguarded" / rel).read_bytes()
        for rel in (RUNNER_FILE, PLATFORM_FILE)
    }
    return flow


@pytest.fixture(scope="module")
def state_spec_flow(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, Any]:
    """Editable setuptools plugin whose runner declares vLLM's GDN MambaSpec: apply, after."""
    work = tmp_path_factory.mktemp("state-spec")
    install_plugin(vllm_python, "mamba_state", work, editable=True)
    catalog = copy_catalog(work / "catalog")
    flow = {"apply": patch_cli(vllm_python, catalog, "apply")}
    flow["after"] = run_scenarios(vllm_python, work / "after.json")
    return flow


def concurrency_line(case: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    ratio = after["max_concurrency"] / before["max_concurrency"]
    return (f"{case:24} max concurrency {before['max_concurrency']:6.1f} -> "
            f"{after['max_concurrency']:6.1f} (x{ratio:.2f}); "
            f"KV bytes/token {before['bytes_per_token']:7.0f} -> {after['bytes_per_token']:6.0f}")


@pytest.mark.slow
def test_apply_finds_the_editable_checkout(per_layer_flow: dict[str, Any]) -> None:
    """apply patches the files of the editable checkout the target interpreter imports."""
    applied = per_layer_flow["apply"]
    assert applied["exit"] == 0 and verdicts(applied) == {RUNNER_ID: "applied",
                                                          PLATFORM_ID: "applied"}
    checkout = per_layer_flow["checkout"]
    files = {p["id"]: Path(p["file"]).resolve() for p in applied["patches"]}
    assert files == {RUNNER_ID: (checkout / RUNNER_FILE).resolve(),
                     PLATFORM_ID: (checkout / PLATFORM_FILE).resolve()}


@pytest.mark.slow
def test_budget_falls_to_the_full_attention_layers(per_layer_flow: dict[str, Any]) -> None:
    """Hybrid configs: vLLM's real grouping gets only full-attention layers; concurrency x4."""
    before, after = per_layer_flow["before"]["runner"], per_layer_flow["after"]["runner"]
    for case in HYBRID_CASES:
        tp = case.rsplit("/", 1)[1]
        old, new = before[case]["patched"], after[case]["patched"]
        print(concurrency_line(case, old, new))
        assert before[case]["hybrid_kv_cache_manager_disabled"] is True
        assert "error" not in old and "error" not in new
        assert len(old["layers"]) == 8 and old["max_concurrency"] == CONCURRENCY_ALL_LAYERS[tp]
        assert [name for name, _, _ in new["layers"]] == FULL_ATTENTION_LAYERS
        assert new["groups"] == [["FullAttentionSpec", FULL_ATTENTION_LAYERS]]
        assert new["max_concurrency"] == CONCURRENCY_FULL_ATTENTION[tp]
        assert new["bytes_per_token"] * 4 == old["bytes_per_token"]
        assert after[case]["original"] == old  # the unwrapped method still gives the old spec


@pytest.mark.slow
def test_non_hybrid_spec_is_byte_for_byte_the_same(per_layer_flow: dict[str, Any]) -> None:
    """A Llama-like config gets the identical spec (names, order, every field) and budget."""
    before, after = per_layer_flow["before"]["runner"], per_layer_flow["after"]["runner"]
    for case in LLAMA_CASES:
        assert after[case]["patched"] == before[case]["patched"]
        assert len(after[case]["patched"]["layers"]) == 8


@pytest.mark.slow
def test_hybrid_configs_lose_prefix_caching_and_pass_validation(
        per_layer_flow: dict[str, Any]) -> None:
    """--enable-prefix-caching on a hybrid model: off, contiguous blocks, valid, one warning."""
    before, after = per_layer_flow["before"]["platform"], per_layer_flow["after"]["platform"]
    for case in HYBRID_CASES:
        assert before[case]["enable_prefix_caching"] is True  # unpatched: wrong outputs ahead
        new = after[case]
        assert "error" not in new, new
        assert new["enable_prefix_caching"] is False
        assert new["block_size"] == new["max_model_len"] == 1024
        assert new["mamba_cache_mode"] == "none"
        assert len(new["warnings"]) == 1 and PLATFORM_ID in new["warnings"][0]
    # vLLM knows Qwen3-Next as hybrid and had derived the mamba fields from prefix caching.
    assert before["qwen3_next_tiny/tp1"]["mamba_cache_mode"] == "align"
    assert after["qwen3_next_tiny/tp1"]["mamba_block_size"] == 1024


@pytest.mark.slow
def test_non_hybrid_and_modelless_configs_are_untouched(per_layer_flow: dict[str, Any]) -> None:
    """Llama-like configs keep prefix caching; a default VllmConfig() is built as before."""
    before, after = per_layer_flow["before"], per_layer_flow["after"]
    for case in LLAMA_CASES:
        assert after["platform"][case] == before["platform"][case]
        assert after["platform"][case]["enable_prefix_caching"] is True
    assert after["default_config"] == before["default_config"]
    assert after["default_config"]["model_config_is_none"] is True


@pytest.mark.slow
def test_blocks_wrap_once_after_reload_and_a_second_run(per_layer_flow: dict[str, Any]) -> None:
    """importlib.reload and executing a block again both leave exactly one wrapper."""
    for wrapping in per_layer_flow["after"]["wrapping"].values():
        assert (wrapping["block_present"], wrapping["after_reload"],
                wrapping["after_second_exec"]) == (True, 1, 1)
    for wrapping in per_layer_flow["before"]["wrapping"].values():
        assert (wrapping["block_present"], wrapping["after_reload"]) == (False, 0)


@pytest.mark.slow
def test_deep_verify_runs_both_probes(per_layer_flow: dict[str, Any]) -> None:
    """verify --deep imports the patched modules in the venv and the probes pass."""
    deep = per_layer_flow["deep"]
    assert deep["exit"] == 0 and verdicts(deep) == {RUNNER_ID: "applied", PLATFORM_ID: "applied"}
    assert all("wrapped once" in p["reason"] for p in deep["patches"]), deep["patches"]


@pytest.mark.slow
def test_revert_restores_the_checkout_byte_for_byte(per_layer_flow: dict[str, Any]) -> None:
    """revert gives back the original bytes; verify then reports both patches missing."""
    assert verdicts(per_layer_flow["revert"]) == {RUNNER_ID: "reverted", PLATFORM_ID: "reverted"}
    assert per_layer_flow["restored"] == {RUNNER_FILE: True, PLATFORM_FILE: True}
    reverted = per_layer_flow["verify_reverted"]
    assert reverted["exit"] == 1
    assert verdicts(reverted) == {RUNNER_ID: "missing", PLATFORM_ID: "missing"}


@pytest.mark.slow
def test_non_editable_plugin_is_patched_in_site_packages(unguarded_flow: dict[str, Any],
                                                         vllm_python: Path) -> None:
    """A wheel install (setuptools, another runner body) is patched in place and works the same."""
    applied = unguarded_flow["apply"]
    assert applied["exit"] == 0 and set(verdicts(applied).values()) == {"applied"}
    installed = site_packages(vllm_python.parent.parent).resolve()
    assert all(Path(p["file"]).resolve().is_relative_to(installed) for p in applied["patches"])
    runner, platform = unguarded_flow["after"]["runner"], unguarded_flow["after"]["platform"]
    for case in HYBRID_CASES:
        tp = case.rsplit("/", 1)[1]
        new, old = runner[case]["patched"], runner[case]["original"]
        print(concurrency_line(case, old, new))
        assert [name for name, _, _ in new["layers"]] == FULL_ATTENTION_LAYERS
        assert (old["max_concurrency"], new["max_concurrency"]) == (
            CONCURRENCY_ALL_LAYERS[tp], CONCURRENCY_FULL_ATTENTION[tp])
        assert (platform[case]["enable_prefix_caching"], platform[case]["block_size"]) == (
            False, 1024)
    for case in LLAMA_CASES:
        assert runner[case]["patched"] == runner[case]["original"]
        assert platform[case]["enable_prefix_caching"] is True
    assert unguarded_flow["restored"] == {RUNNER_FILE: True, PLATFORM_FILE: True}


@pytest.mark.slow
def test_hook_without_early_return_still_gets_modelless_configs(
        unguarded_flow: dict[str, Any]) -> None:
    """With no model_config-is-None return in the original, VllmConfig() still builds, silently."""
    default = unguarded_flow["after"]["default_config"]
    assert "error" not in default and default["warnings"] == []


@pytest.mark.slow
def test_state_spec_runner_fails_on_neuron_path_and_works_patched(
        state_spec_flow: dict[str, Any]) -> None:
    """vLLM's own GDN MambaSpec raises ValueError without the hybrid manager; patched it groups."""
    assert set(verdicts(state_spec_flow["apply"]).values()) == {"applied"}
    runner = state_spec_flow["after"]["runner"]
    for case in HYBRID_CASES:
        tp = case.rsplit("/", 1)[1]
        original, patched = runner[case]["original"], runner[case]["patched"]
        assert original["error"].startswith(
            "ValueError: Hybrid KV cache manager is disabled but failed to convert"), original
        assert sorted({kind for _, kind, _ in original["layers"]}) == ["FullAttentionSpec",
                                                                       "MambaSpec"]
        assert patched["groups"] == [["FullAttentionSpec", FULL_ATTENTION_LAYERS]]
        assert patched["max_concurrency"] == CONCURRENCY_FULL_ATTENTION[tp]
        print(f"{case:24} state-spec runner: {original['error'][:60]}... -> max concurrency "
              f"{patched['max_concurrency']:.1f}")
    for case in LLAMA_CASES:
        assert runner[case]["patched"] == runner[case]["original"]


@pytest.mark.slow
def test_aggregated_runner_is_not_applicable(vllm_python: Path, tmp_path: Path) -> None:
    """The aggregated "layer" runner is left as it is (not-applicable); the platform is patched."""
    install_plugin(vllm_python, "aggregated", tmp_path, editable=False)
    catalog = copy_catalog(tmp_path / "catalog")
    result = patch_cli(vllm_python, catalog, "apply")
    assert result["exit"] == 0, json.dumps(result)
    assert verdicts(result) == {RUNNER_ID: "not-applicable", PLATFORM_ID: "applied"}
    reasons = {p["id"]: p["reason"] for p in result["patches"]}
    assert "aggregated 'layer' entry" in reasons[RUNNER_ID]
    installed = site_packages(vllm_python.parent.parent)
    assert (installed / RUNNER_FILE).read_bytes() == (FIXTURES / "aggregated" / RUNNER_FILE
                                                      ).read_bytes()
    assert b"# >>> hatch-vllm-patch: " + PLATFORM_ID.encode() in (installed / PLATFORM_FILE
                                                                  ).read_bytes()
    assert verdicts(patch_cli(vllm_python, catalog, "revert"))[PLATFORM_ID] == "reverted"


@pytest.mark.slow
def test_pypi_placeholder_is_named_as_such(tmp_path: Path) -> None:
    """PyPI's vllm-neuron 0.1.0 (AWS's "WRONG PACKAGE" placeholder, no vllm_neuron package):
    the Neuron patches say so and where the real plugin comes from; optional, so exit 0."""
    from support.venvs import cached_wheel

    python = create_venv(tmp_path / "venv")
    run([UV, "pip", "install", "--quiet", "--no-deps", "--python", str(python),
         str(cached_wheel("vllm-neuron", "0.1.0"))])
    before = sorted(p.name for p in site_packages(tmp_path / "venv").iterdir())
    for op in ("verify", "apply"):
        proc = cli(op, "--python", str(python), "--patch", RUNNER_ID, "--patch", PLATFORM_ID,
                   "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for outcome in json.loads(proc.stdout)["patches"]:
            assert outcome["verdict"] == "not-installed", outcome
            assert "vllm-neuron 0.1.0 is installed, but it provides no importable vllm_neuron" \
                in outcome["reason"]
            assert "WRONG PACKAGE" in outcome["reason"]
            assert "pip.repos.neuron.amazonaws.com" in outcome["reason"]
    after = sorted(p.name for p in site_packages(tmp_path / "venv").iterdir())
    # only the record and the environment's lock file (at site-packages' top, never in vLLM's)
    assert [n for n in after if n not in {".hatch-vllm-patch.json", ".hatch-vllm-patch.lock"}
            ] == [n for n in before if n != ".hatch-vllm-patch.lock"]
