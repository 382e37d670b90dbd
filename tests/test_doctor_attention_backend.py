"""doctor's --attention-backend and --gpu: the backend (vLLM's names) and the GPU it models, and
the model class it inspects, checked against vLLM's own code.

Fast tests: the options' parsing and usage errors, vLLM's backend choice per GPU, the names read
from a registry file, and the prefix verdict naming a bug's patch only where doctor's run with it
reuses correctly.

Slow tests on vLLM 0.34.0 (``full_vllm_planning_env``, shared per process and left as found):
- a sliding-window drafter next to a hybrid target whose pages match the scenario of
  tests/support/prefix_scenarios/drafter_window.py (1152 B/token target attention, 512 B/token
  drafter, 1536-token blocks): doctor with ``--attention-backend FLASHINFER`` on a Hopper says bug 2
  and names hybrid-prefix-drafter-window (its run with the patch reuses correctly), with FLASH_ATTN
  it says the state is reused correctly; the scenario, run by vLLM's EngineCore and scheduler with a
  drafter declaring the kernel block sizes doctor reported for each backend, gives the same groups,
  the same scheduler block and a resend hit of 0 (FlashInfer) and 19,968 (FlashAttention; and
  FlashInfer with the patch's block);
- an unknown backend name is a usage error (exit 2) naming the installed vLLM's backends;
- Qwen3.5/3.6 on the CUDA path: doctor inspects vllm/models/qwen3_5/nvidia (what vLLM loads on
  CUDA), and its state shapes and layer specs equal those of the class vLLM loads elsewhere.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.models import SCENARIO, window_models

from hatch_vllm_patch import _kv_probe
from hatch_vllm_patch.doctor import (
    GPUS,
    INSTALLED,
    DoctorRequest,
    Gpu,
    attention_backend_names,
    case_of,
    check_backend_name,
    check_path_options,
    judge_prefix,
    parse_gpu,
    run_child,
    vllm_backend_choice,
)
from hatch_vllm_patch.engine import Verdict
from hatch_vllm_patch.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
PATCH = "hybrid-prefix-drafter-window"
BLOCK = REPO / "patches" / PATCH / "block.py"
FULL_HIT = 19968  # the scenario's 20,000-token resend: every whole 1536-token block
GRANITE = REPO / "tests" / "fixtures" / "doctor" / "granite-4.0-h-tiny"
QWEN36 = REPO / "example_project" / "models" / "qwen3.6-finetune"
TORCHVISION_STUB = REPO / "tests" / "fixtures" / "torchvision_stub"


# --- the options, without vLLM ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "capability", "generation"), [
    (None, (9, 0), "Hopper"), ("H100", (9, 0), "Hopper"), ("a100", (8, 0), "Ampere"),
    ("L40S", (8, 9), "Ada Lovelace"), ("NVIDIA B200", (10, 0), "Blackwell"),
    ("rtx-5090", (12, 0), "Blackwell"), ("9.0", (9, 0), "Hopper"), ("8.6", (8, 6), "Ampere"),
    ("10.3", (10, 3), "Blackwell"),
])
def test_gpu_by_name_or_capability(text: str | None, capability: tuple[int, int],
                                   generation: str) -> None:
    """--gpu takes a GPU's name (any case, spaces and dashes ignored) or a compute capability;
    left out, it is a Hopper (H100)."""
    gpu = parse_gpu(text)
    assert gpu.capability == capability and gpu.generation == generation
    assert generation in gpu.label and f"{capability[0]}.{capability[1]}" in gpu.label


@pytest.mark.parametrize("text", ["X99", "9", "9.0.1", "H100x", ""])
def test_unknown_gpu_is_a_usage_error(text: str) -> None:
    """A --gpu that is neither a known name nor a compute capability is a usage error that
    names both forms."""
    with pytest.raises(UsageError, match=r"compute capability such as 9\.0.*H100"):
        parse_gpu(text)


def test_vllms_choice_of_backend_per_gpu() -> None:
    """Without --attention-backend the backend is vLLM's first choice for the GPU: FlashInfer on
    compute capability 10.x, FlashAttention on every other one (Ampere, Hopper, 12.x)."""
    chosen = {name: vllm_backend_choice(Gpu(name, cap)) for name, cap in GPUS.items()}
    assert {n for n, b in chosen.items() if b == "FLASHINFER"} == {
        n for n, cap in GPUS.items() if cap[0] == 10}
    assert chosen["H100"] == chosen["A100"] == chosen["RTX5090"] == "FLASH_ATTN"


def test_backend_names_from_the_registry_file(tmp_path: Path) -> None:
    """vLLM's backend names are the members of AttentionBackendEnum in the installed registry
    file, each with its class path; a member without one (a tag) is left out; no file or no
    enum: None."""
    registry = tmp_path / "registry.py"
    registry.write_text('from enum import Enum\n\nclass AttentionBackendEnum(Enum):\n'
                        '    """doc"""\n    FLASH_ATTN = "a.b.FlashAttentionBackend"\n'
                        '    FLASHINFER = (\n        "a.c.FlashInferBackend"\n    )\n'
                        '    TORCH_SDPA = ""  # a tag\n\n    def get_class(self): ...\n')
    assert attention_backend_names(registry) == {"FLASH_ATTN": "a.b.FlashAttentionBackend",
                                                 "FLASHINFER": "a.c.FlashInferBackend"}
    assert attention_backend_names(tmp_path / "absent.py") is None
    assert attention_backend_names(None) is None
    (tmp_path / "other.py").write_text("X = 1\n")
    assert attention_backend_names(tmp_path / "other.py") is None


def test_backend_name_checks() -> None:
    """An --attention-backend vLLM does not name is a usage error listing those it does (with the
    close match); another platform's backend is not one of them on the CUDA path; --gpu and a GPU
    backend are refused on the CPU path."""
    names = {"FLASH_ATTN": "x", "FLASHINFER": "y", "CPU_ATTN": "z", "ROCM_ATTN": "r"}
    check_backend_name(DoctorRequest("m", attention_backend="FLASHINFER"), names)
    check_backend_name(DoctorRequest("m"), names)
    with pytest.raises(UsageError, match=r"did you mean FLASHINFER\?.*one of FLASHINFER, "
                                         r"FLASH_ATTN$"):
        check_backend_name(DoctorRequest("m", attention_backend="FLASHINFR"), names)
    with pytest.raises(UsageError, match=r"one of FLASHINFER, FLASH_ATTN$"):
        check_backend_name(DoctorRequest("m", attention_backend="ROCM_ATTN"), names)
    with pytest.raises(UsageError, match=r"one of FLASH_ATTN$"):  # a vLLM without the enum
        check_backend_name(DoctorRequest("m", attention_backend="FLASHINFER"), None)
    check_path_options(DoctorRequest("m", platform="cpu", attention_backend="CPU_ATTN"))
    with pytest.raises(UsageError, match="--platform cpu"):
        check_path_options(DoctorRequest("m", platform="cpu", gpu="H100"))
    with pytest.raises(UsageError, match="CPU_ATTN"):
        check_path_options(DoctorRequest("m", platform="cpu", attention_backend="FLASHINFER"))


def test_case_carries_backend_and_gpu() -> None:
    """The child's case names the backend (vLLM's choice when none is given) and the GPU's
    compute capability on the CUDA path; the CPU path names the CPU backend and no GPU."""
    case = case_of(DoctorRequest("m"), Path("/m"), None, False)
    assert (case["attention_backend"], case["gpu_capability"]) == ("FLASH_ATTN", [9, 0])
    case = case_of(DoctorRequest("m", gpu="B200"), Path("/m"), None, False)
    assert (case["attention_backend"], case["gpu_capability"]) == ("FLASHINFER", [10, 0])
    case = case_of(DoctorRequest("m", gpu="8.9", attention_backend="TRITON_ATTN"), Path("/m"),
                   None, False)
    assert (case["attention_backend"], case["gpu_capability"]) == ("TRITON_ATTN", [8, 9])
    case = case_of(DoctorRequest("m", platform="cpu"), Path("/m"), None, False)
    assert case["attention_backend"] == "CPU_ATTN" and "gpu_capability" not in case


@pytest.mark.parametrize("args", [["--gpu", "X99"], ["--platform", "cpu", "--gpu", "H100"],
                                  ["--platform", "cpu", "--attention-backend", "FLASHINFER"]])
def test_cli_usage_errors_before_the_target(args: list[str]) -> None:
    """A bad --gpu, or a GPU option on the CPU path, exits 2 with one line and no traceback,
    before any target interpreter is asked (--python names none that exists)."""
    proc = subprocess.run([sys.executable, "-m", "hatch_vllm_patch", "doctor", "--model",
                           str(GRANITE), "--python", "/nonexistent/python", *args],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("vllm-patch: error: ")


# --- a prefix bug's patch is named only where doctor's run with it reuses correctly ------------


def _window_facts(**over: Any) -> dict[str, Any]:
    groups = [{"type": "MambaSpec", "layers": 3, "block_size": 1536},
              {"type": "FullAttentionSpec", "layers": 1, "block_size": 1536},
              {"type": "SlidingWindowSpec", "layers": 1, "block_size": 3456,
               "sliding_window": 2048}]
    return {"enable_prefix_caching": True, "mamba_cache_mode": "align", "mamba_block_size": 1536,
            "engine_block_size": 1536, "scheduler_block_size": 13824, "hash_block_size": 1536,
            "hit_alignment": 13824, "groups": groups, "seeding": {"runner": "v2"}, **over}


def test_patch_named_only_where_its_run_reuses_correctly() -> None:
    """Bug 2 found: where doctor's run with the catalog patch reuses correctly, the verdict names
    it to select, with what the run gave; where that run has the bug still, it says the patch
    does not fix this case and names none to select."""
    catalog: dict[str, Any] = {PATCH: object()}
    status = {PATCH: Verdict.MISSING}
    fixed = _window_facts(scheduler_block_size=1536, hit_alignment=1536, groups=[
        {**g, "block_size": 1536} for g in _window_facts()["groups"]])
    verdict = judge_prefix(_window_facts(), catalog, status, "cuda", {PATCH: fixed})
    assert verdict is not None and (verdict.outcome, verdict.patch) == ("no-hits", PATCH)
    assert "fixes it (with it, doctor's run: reuses state correctly" in verdict.fix
    verdict = judge_prefix(_window_facts(), catalog, status, "cuda", {PATCH: _window_facts()})
    assert verdict is not None and (verdict.outcome, verdict.patch) == ("no-hits", None)
    assert "applies here but does not fix this case" in verdict.fix
    assert "pull/52804" in verdict.fix
    verdict = judge_prefix(_window_facts(), catalog, status, "cuda")  # not run: as before
    assert verdict is not None and verdict.patch == PATCH


# --- vLLM 0.34.0 ----------------------------------------------------------------------------------


def _doctor(python: Path, models: dict[str, Path], *extra: str) -> subprocess.CompletedProcess[str]:
    from support.venvs import scrubbed_environ

    draft = json.dumps({"method": "draft_model", "model": str(models["draft"]),
                        "num_speculative_tokens": 2})
    return subprocess.run(
        [sys.executable, "-m", "hatch_vllm_patch", "doctor", "--python", str(python), "--model",
         str(models["target"]), "--block-size", "1536", "--max-model-len", "32768",
         "--speculative-config", draft, *extra],
        capture_output=True, text=True, cwd=REPO, env=scrubbed_environ(), timeout=1800,
        check=False)


def _scenario_kernels(sizes: list[str]) -> str:
    """doctor's reported kernel block sizes as the scenario's case argument."""
    if len(sizes) == 1 and sizes[0].startswith("MultipleOf("):
        return "multiple-of-" + sizes[0].removeprefix("MultipleOf(").removesuffix(")")
    return ",".join(str(int(s)) for s in sizes)


@pytest.mark.slow
def test_flashinfer_window_drafter_on_0_34(tmp_path: Path) -> None:
    """vLLM 0.34.0, a sliding-window drafter, a Hopper: with --attention-backend FLASHINFER doctor
    says prefix caching loses reuse (bug 2) and names hybrid-prefix-drafter-window, whose run
    reuses correctly; with FLASH_ATTN it reuses correctly. vLLM's own EngineCore and scheduler (the
    drafter_window scenario), with a drafter declaring the kernel block sizes doctor reported for
    each backend, plans the same group blocks and scheduler block, and an identical 20,000-token
    resend hits 0 tokens with FlashInfer's sizes (19,968 with the patch's block) and 19,968 with
    FlashAttention's. On a B200 without --attention-backend, doctor models vLLM's first choice
    there, FlashInfer, with the large pages it declares on Blackwell."""
    from support.venvs import full_vllm_planning_env, run, site_packages

    python = full_vllm_planning_env("0.34.0")
    models = window_models(tmp_path)
    results = {}
    for backend in ("FLASHINFER", "FLASH_ATTN"):
        proc = _doctor(python, models, "--attention-backend", backend, "--json")
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        results[backend] = json.loads(proc.stdout)["result"]
    assert all(r["vllm"] == "0.34.0" and r["starts"] for r in results.values())
    fi, fa = results["FLASHINFER"], results["FLASH_ATTN"]
    assert fi["modelled"]["attention_backend"] == "FLASHINFER"
    assert fi["modelled"]["attention_backend_chosen_by"] == "--attention-backend"
    assert fi["modelled"]["gpu"] == {"name": "H100", "generation": "Hopper",
                                     "compute_capability": "9.0"}
    assert fi["modelled"]["kernel_block_sizes"] == ["16", "32", "64"]
    assert fi["options"]["attention_backend"] == "FLASHINFER" and fi["options"]["gpu"] is None
    assert fa["modelled"]["kernel_block_sizes"] == ["MultipleOf(16)"]
    assert "FlashAttentionBackend" in fa["modelled"]["kernel_block_sizes_from"]
    prefix = fi["prefix_caching"]
    assert (prefix["outcome"], prefix["bug"], prefix["patch"]) == ("no-hits", 2, PATCH)
    assert prefix["patch_status"] == "missing" and "LOSES REUSE" in prefix["what"]
    assert f"{PATCH} fixes it (with it, doctor's run: reuses state correctly" in prefix["fix"]
    assert fa["prefix_caching"]["outcome"] == "correct" and fa["prefix_caching"]["bug"] is None

    # FlashInfer's record (its class does not import without flashinfer-python): the sizes its
    # class returns in the installed source, before Blackwell and on it
    source = site_packages(python.parent.parent) / "vllm/v1/attention/backends/flashinfer.py"
    declared = _returned_lists(source, "FlashInferBackend", "get_supported_kernel_block_sizes")
    record = _kv_probe.DECLARED["FLASHINFER"]
    assert sorted(declared) == sorted([record["sizes"], record["blackwell_gqa"]])
    if "doctor's record" in fi["modelled"]["kernel_block_sizes_from"]:
        assert "FlashInferBackend" in fi["modelled"]["kernel_block_sizes_from"]

    # vLLM's scheduler with the same kernel block sizes, as released and with the patch's block
    cases = {b: _scenario_kernels(r["modelled"]["kernel_block_sizes"])
             for b, r in results.items()}
    out = tmp_path / "scenario.json"
    proc = run([str(python), str(SCENARIO), str(out),
                *(f"case:{b}={k}" for b, k in cases.items()),
                f"vllm.v1.core.kv_cache_planning={BLOCK}"], check=False, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["vllm_version"] == "0.34.0" and set(report["cases"]) == set(results)
    for backend, result in results.items():
        measured = report["cases"][backend]
        assert "case_error" not in measured, measured
        prefix = result["prefix_caching"]
        assert {g["block_size"] for g in measured["groups"]} == {
            g["block_size"] for g in prefix["groups"]}, backend
        assert measured["scheduler_block_size"] == prefix["scheduler_block_size"], backend
        hit = measured["resend"]["hit"]
        assert (hit == FULL_HIT) == (prefix["outcome"] == "correct"), (backend, hit)
        assert report["with_blocks"][backend]["resend"]["hit"] == FULL_HIT, backend
    assert report["cases"]["FLASHINFER"]["resend"]["hit"] == 0

    # a Blackwell without --attention-backend: vLLM's first choice there, FlashInfer, whose
    # declaration on 10.x with grouped-query attention (18 heads on 9 KV heads) adds large pages
    proc = _doctor(python, models, "--gpu", "B200", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    blackwell = json.loads(proc.stdout)["result"]["modelled"]
    assert (blackwell["attention_backend"], blackwell["attention_backend_chosen_by"]) == (
        "FLASHINFER", "vLLM's first choice on this GPU")
    assert blackwell["gpu"] == {"name": "B200", "generation": "Blackwell",
                                "compute_capability": "10.0"}
    assert blackwell["kernel_block_sizes"] == ["16", "32", "64", "128", "256", "512", "1024"]

    # the text: the prefix line, and the verdict with what was modelled
    text = _doctor(python, models, "--attention-backend", "FLASHINFER", "--gpu", "9.0")
    assert text.returncode == 0, text.stderr[-3000:]
    lines = text.stdout.splitlines()
    assert next(x for x in lines if x.startswith("prefix caching: ")).startswith(
        "prefix caching: LOSES REUSE")
    verdict = next(x for x in lines if x.startswith("verdict: "))
    assert "modelled: FLASHINFER (--attention-backend), kernel block sizes [16, 32, 64]" in verdict
    assert "(Hopper, compute capability 9.0)" in verdict
    assert "model class vllm.model_executor.models.qwen3_next.Qwen3NextForCausalLM" in verdict
    assert f'    patches = ["{PATCH}"]' in lines


def _returned_lists(source: Path, cls: str, method: str) -> list[list[int]]:
    """The integer list literals that ``cls.method`` returns in ``source``."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    function = next(n for n in klass.body
                    if isinstance(n, ast.FunctionDef) and n.name == method)
    return [ast.literal_eval(node.value) for node in ast.walk(function)
            if isinstance(node, ast.Return) and isinstance(node.value, ast.List)]


@pytest.mark.slow
def test_unknown_backend_on_0_34() -> None:
    """An --attention-backend the installed vLLM 0.34.0 does not name exits 2, with one line that
    names the close match and vLLM's CUDA backends, and no traceback; before vLLM is imported."""
    from support.venvs import full_vllm_planning_env, scrubbed_environ

    python = full_vllm_planning_env("0.34.0")
    proc = subprocess.run([sys.executable, "-m", "hatch_vllm_patch", "doctor", "--python",
                           str(python), "--model", str(GRANITE), "--attention-backend",
                           "FLASHINFR"], capture_output=True, text=True, cwd=REPO,
                          env=scrubbed_environ(), timeout=600, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert "--attention-backend FLASHINFR" in line and "did you mean FLASHINFER?" in line
    listed = line.rsplit("expected one of ", 1)[1].split(", ")
    assert {"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"} <= set(listed)
    assert not any(n.startswith(("CPU_", "ROCM_")) for n in listed)


COMPARE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("_kv_probe", sys.argv[1])
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
case = json.loads(sys.argv[2])
probe.inspect_in_process()
config = probe.build_config(case)

def planned():
    cls, shapes, dtypes = probe.state_shapes(config)
    layer = probe.layer_state_shapes(config, cls, shapes)
    stages, facts = probe.layer_specs(config, case, shapes, dtypes, layer)
    return cls, stages, facts

here, stages, facts = planned()
with probe.cuda_model_class(config, "cuda") as info:
    cuda, cuda_stages, cuda_facts = planned()
print(json.dumps({
    "here": f"{here.__module__}.{here.__qualname__}",
    "cuda": f"{cuda.__module__}.{cuda.__qualname__}",
    "layers": len(stages[0]), "same_specs": stages == cuda_stages,
    "state_shapes": [facts["state_shapes"], cuda_facts["state_shapes"]],
    "state_page": [facts["state_page"], cuda_facts["state_page"]],
    "dispatch": info.get("dispatch")}))
"""


@pytest.mark.slow
def test_qwen3_5_model_class_on_0_34(tmp_path: Path) -> None:
    """vLLM 0.34.0 loads Qwen3.5/3.6 from vllm/models/qwen3_5/nvidia on CUDA and from the old
    model_executor module elsewhere: doctor's CUDA path inspects the nvidia class and says so in
    what it modelled, the CPU path the old one; the two classes give the same state shapes and
    dtypes and the same layer specs (every layer's spec equal, built by doctor's own steps)."""
    from support.venvs import full_vllm_planning_env, run

    python = full_vllm_planning_env("0.34.0")
    overrides = {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}
    request = DoctorRequest(model=str(QWEN36), tensor_parallel_size=2, max_model_len=32768)
    cases = [{**case_of(request._replace(platform=p), QWEN36, overrides, False), "name": p}
             for p in ("cuda", "cpu")]
    answer = run_child(python, {"cases": cases, "variants": [
        {"name": INSTALLED, "patches": [], "blocks": []}]}, timeout=1800,
        extra_paths=[TORCHVISION_STUB])
    got = {e["case"]: e["variants"][INSTALLED] for e in answer["cases"]}
    assert all(raw["failed"] is None for raw in got.values()), got
    cuda, cpu = got["cuda"]["model_class"], got["cpu"]["model_class"]
    assert (cuda["module"], cuda["name"]) == ("vllm.models.qwen3_5.nvidia.model",
                                              "Qwen3_5MoeForConditionalGeneration")
    assert cuda["dispatch"]["cuda_module"] == "vllm.models.qwen3_5.nvidia.model"
    assert cuda["other"]["module"] == "vllm.model_executor.models.qwen3_5"
    assert cuda["other"]["same"] and cuda["other"]["inspected"] == cuda["other"]["other"]
    assert cpu["module"] == "vllm.model_executor.models.qwen3_5" and "dispatch" not in cpu
    assert got["cuda"]["facts"]["state_shapes"] == [[3, 4096], [16, 128, 128]]

    from hatch_vllm_patch.doctor import modelled_of

    line = modelled_of(request, got["cuda"]).line
    assert "model class vllm.models.qwen3_5.nvidia.model.Qwen3_5MoeForConditionalGeneration" \
        in line and "what a CUDA server loads" in line and "are the same" in line

    case = {**cases[0], "model": str(QWEN36)}
    proc = run([str(python), "-c", COMPARE, str(Path(_kv_probe.__file__)), json.dumps(case)],
               env={"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                    "PYTHONPATH": str(TORCHVISION_STUB)}, timeout=1200)
    compared = json.loads(proc.stdout.strip().splitlines()[-1])
    assert compared["here"] == "vllm.model_executor.models.qwen3_5." \
                               "Qwen3_5MoeForConditionalGeneration"
    assert compared["cuda"] == "vllm.models.qwen3_5.nvidia.model." \
                               "Qwen3_5MoeForConditionalGeneration"
    assert compared["layers"] == 40 and compared["same_specs"] is True
    assert compared["state_shapes"][0] == compared["state_shapes"][1]
    assert compared["state_page"][0] == compared["state_page"][1] == 1073152


def test_bug_1_patch_named_whatever_its_run_gives() -> None:
    """Bug 1's patch changes the scheduler's split and the runner's seeding, which doctor's facts
    do not replay: its run is not asked, and the patch is named as before."""
    pid = "hybrid-prefix-mamba-block"
    groups = [{"type": "MambaSpec", "layers": 3, "block_size": 64},
              {"type": "FullAttentionSpec", "layers": 1, "block_size": 32}]
    wrong = _window_facts(mamba_block_size=64, engine_block_size=32, scheduler_block_size=64,
                          hit_alignment=32, groups=groups)
    verdict = judge_prefix(wrong, {pid: object()}, {pid: Verdict.MISSING}, "cuda", {pid: wrong})
    assert verdict is not None and (verdict.outcome, verdict.patch) == ("wrong-state", pid)
    assert verdict.fix.endswith(f"{pid} fixes it: select it")


def test_modelled_line_from_the_childs_answer() -> None:
    """What was modelled, in the verdict's words: the backend and who chose it, its kernel block
    sizes and where they were read (the class, or doctor's record with why the class could not
    be asked), the GPU, the model class and, where vLLM picks model code by platform, which."""
    from hatch_vllm_patch.doctor import modelled_of

    raw = {"platform": {"attention_backend": {
        "source": "record", "class": "FlashInferBackend", "record": "fixed sizes",
        "import_error": {"type": "ModuleNotFoundError", "message": "No module named 'x'"},
        "kernel_block_sizes": ["16", "32", "64"]}},
        "model_class": {"module": "m.nvidia.model", "name": "C",
                        "dispatch": {"registry_module": "m", "class": "C",
                                     "cuda_module": "m.nvidia.model"},
                        "other": {"module": "old", "name": "C", "same": True}}}
    modelled = modelled_of(DoctorRequest("m", attention_backend="FLASHINFER", gpu="A100"), raw)
    assert modelled.line == (
        "modelled: FLASHINFER (--attention-backend), kernel block sizes [16, 32, 64] (doctor's "
        "record of vLLM's FlashInferBackend: fixed sizes; its class does not import here: "
        "ModuleNotFoundError: No module named 'x') on A100 (Ampere, compute capability 8.0); "
        "model class m.nvidia.model.C (what a CUDA server loads: vLLM's m imports it when "
        "current_platform.is_cuda(); elsewhere it loads old.C, whose state shapes and dtypes "
        "are the same, so the same layer specs)")
    document = modelled.to_json()
    assert document["gpu"] == {"name": "A100", "generation": "Ampere",
                               "compute_capability": "8.0"}
    raw["model_class"] = {"module": "old", "name": "C", "dispatch": raw["model_class"]["dispatch"],
                          "cuda_import_error": {"type": "ImportError", "message": "no GPU"}}
    raw["platform"]["attention_backend"] = {"source": "class", "class": "a.FlashInferBackend",
                                            "kernel_block_sizes": ["16"]}
    line = modelled_of(DoctorRequest("m", gpu="B200"), raw).line
    assert line.startswith("modelled: FLASHINFER (vLLM's first choice on this GPU), kernel "
                           "block sizes [16] (read from a.FlashInferBackend) on B200 (Blackwell")
    assert "on CUDA m loads m.nvidia.model.C, which does not import here (ImportError: no GPU)" \
        in line
    cpu = modelled_of(DoctorRequest("m", platform="cpu"), {})
    assert cpu.line == "modelled: CPU_ATTN (the CPU platform's backend) on the CPU platform"
    assert cpu.to_json()["gpu"] is None


@pytest.mark.parametrize(("given", "taken"), [
    (None, None), ("auto", None), ("AUTO", None), ("flashinfer", "FLASHINFER"),
    ("Flash_Attn", "FLASH_ATTN"), ("FLASHINFR", "FLASHINFR")])
def test_backend_name_as_vllm_takes_it(given: str | None, taken: str | None) -> None:
    """--attention-backend is read as vLLM reads its own option: the enum's name in any case,
    "auto" (or nothing) for vLLM's choice; a wrong name stays wrong, for the check to name."""
    from hatch_vllm_patch._cli import _parser, doctor_request

    args = ["doctor", "--model", str(GRANITE)] + (
        ["--attention-backend", given] if given is not None else [])
    assert doctor_request(_parser().parse_args(args)).attention_backend == taken
