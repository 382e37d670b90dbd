"""doctor without vLLM: its inputs, the hub-cache lookup, the verdict from runs, the lines it
prints for pyproject.toml, and the probe's in-process patch activation (which must leave the
modules exactly as they were). The real-vLLM half is tests/test_doctor_vllm.py."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import types
from pathlib import Path

import pytest

from hatch_vllm_patch import _kv_probe
from hatch_vllm_patch._cli import main
from hatch_vllm_patch.catalog import Patch, Target
from hatch_vllm_patch.doctor import (
    ALL_TOGETHER,
    INSTALLED,
    Cost,
    Run,
    Step,
    blocks_of,
    compatible,
    concerns,
    config_lines,
    inspection_cause,
    judge,
    native_copy,
    parse_memory,
    refuse_unregistered,
    remote_code_of,
    resolve_model,
    shorten,
    unregistered_override,
    variants,
)
from hatch_vllm_patch.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
FINETUNE = REPO / "example_project" / "models" / "qwen3.6-finetune"


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 << 30), ("512MiB", 512 << 20), ("16GB", 16 * 10**9), ("1073741824", 1 << 30),
    ("1.5GiB", 3 << 29), ("8 gib", 8 << 30),
])
def test_memory_sizes(text: str, expected: int) -> None:
    """--kv-cache-memory takes bytes or binary/decimal units."""
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["8XB", "", "GiB", "-1", "0"])
def test_bad_memory_sizes(text: str) -> None:
    """A size that is not one is a usage error naming the option."""
    with pytest.raises(UsageError, match="--kv-cache-memory"):
        parse_memory(text)


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-cache-memory", "lots"], "--kv-cache-memory 'lots'"),
    (["--speculative-config", "{mtp"], "--speculative-config '{mtp': not JSON"),
    (["--speculative-config", "[1]"], "expected a JSON object"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0: must be 1 or more"),
])
def test_cli_usage_errors_exit_2(args: list[str], message: str) -> None:
    """Bad doctor options give one line and exit 2, before any environment is touched."""
    code, out, err = cli("doctor", "--model", str(FINETUNE), *args)
    assert code == 2
    assert message in err and "Traceback" not in err + out
    assert "imports vLLM" not in err  # said only when it imports


def test_help_names_the_exit_codes() -> None:
    """`doctor --help` says what each exit code means, 3 (a patch is needed) among them."""
    code, out, _ = cli("doctor", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "exit codes: 0 it starts as installed, no patch needed; 3 a patch is needed" in text
    assert "--all" in text


def test_cli_usage_error_as_json() -> None:
    """With --json the usage error is one JSON object, in the schema of the other commands."""
    import jsonschema

    schema = json.loads((Path(__file__).parents[1] / "hatch_vllm_patch" / "schema"
                         / "output.schema.json").read_text())
    code, out, _ = cli("doctor", "--model", "no/such-model-here", "--json")
    assert code == 2
    data = json.loads(out)
    jsonschema.validate(data, schema)
    assert (data["operation"], data["exit_code"], data["ok"]) == ("doctor", 2, False)
    assert "not in the local Hugging Face cache" in data["errors"][0]


def test_hub_id_from_the_local_cache(tmp_path: Path) -> None:
    """A hub id resolves to the snapshot refs/main names, offline."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "snapshots" / "old").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert resolve_model("acme/tiny", {"HF_HOME": str(tmp_path)}) == snapshot
    assert resolve_model("acme/tiny", {"HF_HUB_CACHE": str(tmp_path / "hub")}) == snapshot


def test_hub_id_not_cached_says_where_it_looked(tmp_path: Path) -> None:
    """A hub id that is not cached is a usage error naming the folder it looked for."""
    with pytest.raises(UsageError) as caught:
        resolve_model("acme/absent", {"HF_HOME": str(tmp_path)})
    assert str(tmp_path / "hub" / "models--acme--absent") in str(caught.value)
    assert "never goes online" in str(caught.value)


def test_directory_without_config(tmp_path: Path) -> None:
    """A model directory needs config.json."""
    with pytest.raises(UsageError, match=r"has no config\.json"):
        resolve_model(str(tmp_path))


def test_unregistered_finetune_runs_as_its_base() -> None:
    """The example fine-tune's own architecture name is replaced by its family's, with a note
    naming vLLM's --hf-overrides; a registered name is left alone."""
    override, note = unregistered_override(FINETUNE, ["Qwen3_5MoeForConditionalGeneration"])
    assert override == {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}
    assert note is not None and "--hf-overrides" in note
    assert unregistered_override(FINETUNE, ["AcmeQwen3_6MoeForConditionalGeneration"]) == (
        None, None)


def _cost(page: int, tokens: int = 1000) -> Cost:
    return Cost(page, 1000, 16, 10, tokens, None, ("FullAttentionSpec x1 (block 16)",))


def _run(name: str, patches: tuple[str, ...], fails: str | None = None,
         cost: Cost | None = None, shapes: tuple[tuple[int, ...], ...] = ((3, 4),)) -> Run:
    failed = Step(fails, False, "NotImplementedError: no") if fails else None
    steps = (Step("config", True), *((failed,) if failed else ()))
    return Run(name, patches, steps, failed, None if fails else cost or _cost(1024), shapes)


def test_judge_nothing_needed() -> None:
    """Starts as installed and no patch changes anything: nothing needed."""
    runs = [_run(INSTALLED, ()), _run("p", ("p",))]
    assert judge(runs, ["p"]) == ((), "starts as installed: nothing needed")


def test_judge_a_patch_that_changes_what_vllm_allocates() -> None:
    """Starts, but a patch gives the state other (larger) shapes: it is needed, and the
    verdict says the installed state is too small, with both shapes."""
    runs = [_run(INSTALLED, ()), _run("p", ("p",), shapes=((5, 4),)), _run("q", ("q",))]
    needed, verdict = judge(runs, ["p", "q"])
    assert needed == ("p",)
    assert verdict == ("starts as installed, but sizes the recurrent state wrongly for these "
                       "settings: p is needed (state shapes (3, 4) as installed, (5, 4) with "
                       "it; the installed ones are too small for them)")


def test_judge_a_patch_that_only_lays_pages_out_differently() -> None:
    """Starts, and a patch changes only pages and padding: nothing needed, the patch named
    with the table (whose tokens per GiB, not an "optional", weigh it)."""
    runs = [_run(INSTALLED, ()), _run("p", ("p",), cost=_cost(2048))]
    needed, verdict = judge(runs, ["p"])
    assert needed == ()
    assert verdict == ("starts as installed: nothing needed (p lays out the same state in "
                       "other pages: see the table)")


def test_judge_the_patch_that_fixes_it() -> None:
    """Fails as installed, one patch alone starts it: that patch."""
    runs = [_run(INSTALLED, (), "page unification"), _run("p", ("p",), "page unification"),
            _run("q", ("q",)), _run(ALL_TOGETHER, ("p", "q"))]
    needed, verdict = judge(runs, ["p", "q"])
    assert needed == ("q",) and "q fixes it" in verdict


def test_judge_only_together() -> None:
    """Fails as installed and with each patch alone, starts with all: all of them."""
    runs = [_run(INSTALLED, (), "grouping"), _run("p", ("p",), "grouping"),
            _run("q", ("q",), "kv config"), _run(ALL_TOGETHER, ("p", "q"))]
    assert judge(runs, ["p", "q"])[0] == ("p", "q")


def test_judge_no_patch_fixes_it() -> None:
    """Fails everywhere: nothing to select, and the failing step is named."""
    runs = [_run(INSTALLED, (), "config"), _run("p", ("p",), "config")]
    needed, verdict = judge(runs, ["p"])
    assert needed == ()
    assert verdict.startswith("this fails and no patch here fixes it (config: ")


def _patch(pid: str, *targets: tuple[str, str], architectures: tuple[str, ...] = (),
           replaces: tuple[str, ...] = ()) -> Patch:
    """A patch with one member per (module, symbol) target, blocks naming both."""
    members = tuple(Patch(pid, "s", "", (), "", architectures,
                          Target("vllm", module, (symbol,)), None, {}, f"# {pid} {module}\n",
                          Path(f"/p/{pid}")) for module, symbol in targets)
    first = members[0]
    return first._replace(members=members if len(members) > 1 else (), replaces=replaces)


MODELS = "vllm.model_executor.models."
SPEC_CONV = _patch("spec-conv-num-spec",
                   (MODELS + "falcon_h1", "FalconH1ForCausalLM.get_mamba_state_shape_from_config"),
                   (MODELS + "granitemoehybrid",
                    "GraniteMoeHybridForCausalLM.get_mamba_state_shape_from_config"),
                   (MODELS + "zamba2", "Zamba2ForCausalLM.get_mamba_state_shape_from_config"))
FALCON = _patch("falcon-h1-spec-conv-state",
                (MODELS + "falcon_h1", "FalconH1ForCausalLM.get_mamba_state_shape_from_config"),
                architectures=("FalconH1ForCausalLM",))
BAMBA = _patch("bamba-spec-conv-state", (MODELS + "bamba", "BambaForCausalLM.get_x"),
               architectures=("BambaForCausalLM",))
ENGINE = _patch("engine-wide", ("vllm.v1.core.kv_cache_utils", "unify"))


def test_every_target_of_a_patch_is_activated() -> None:
    """A patch over several modules activates every target's block, each in its module (the
    Granite and Zamba2 modules too, not only the first)."""
    blocks = blocks_of(SPEC_CONV)
    assert [b["module"] for b in blocks] == [MODELS + "falcon_h1", MODELS + "granitemoehybrid",
                                             MODELS + "zamba2"]
    assert all(b["id"] == "spec-conv-num-spec" for b in blocks)
    assert blocks[1]["source"] == f"# spec-conv-num-spec {MODELS}granitemoehybrid\n"


def test_only_patches_for_the_model_are_tried() -> None:
    """A patch declaring architectures is tried for them only; one declaring none, for the
    model whose module or class it targets, or for every model when the project selects it
    (engine code that nothing selects is for settings doctor does not take: --all)."""
    qwen = ({"Qwen3NextForCausalLM"}, {MODELS + "qwen3_next"})
    granite = ({"GraniteMoeHybridForCausalLM"}, {MODELS + "granitemoehybrid"})
    assert not concerns(BAMBA, *qwen) and not concerns(FALCON, *granite)
    assert concerns(FALCON, {"FalconH1ForCausalLM"}, set())
    assert concerns(SPEC_CONV, *granite) and not concerns(SPEC_CONV, *qwen)
    assert concerns(SPEC_CONV, {"Zamba2ForCausalLM"}, set())  # by its class, no registry
    assert not concerns(ENGINE, *qwen)
    assert concerns(ENGINE, *qwen, {"engine-wide"}) and concerns(ENGINE, *granite, {"engine-wide"})


def test_never_two_patches_of_one_symbol_together() -> None:
    """The catalog patch and a project patch of the same classmethod are each run alone, but
    never together; the earlier (preferred) one is kept, the other named in a note."""
    names = [v["name"] for v in variants([FALCON, SPEC_CONV])]
    assert names == [INSTALLED, "falcon-h1-spec-conv-state", "spec-conv-num-spec"]
    names = [v["name"] for v in variants([FALCON, SPEC_CONV, ENGINE])]
    assert names[-1] == ALL_TOGETHER
    together = variants([FALCON, SPEC_CONV, ENGINE])[-1]
    assert together["patches"] == ["falcon-h1-spec-conv-state", "engine-wide"]
    kept, notes = compatible([SPEC_CONV, FALCON])
    assert [p.id for p in kept] == ["spec-conv-num-spec"]
    assert notes == [f"falcon-h1-spec-conv-state and spec-conv-num-spec both replace "
                     f"{MODELS}falcon_h1.FalconH1ForCausalLM.get_mamba_state_shape_from_config: "
                     "they cannot be selected together; spec-conv-num-spec is the one counted"]
    newer = SPEC_CONV._replace(replaces=("falcon-h1-spec-conv-state",))
    kept, notes = compatible([FALCON, newer])
    assert [p.id for p in kept] == ["spec-conv-num-spec"] and "replaces" in notes[0]


def test_messages_are_never_cut_inside_a_word() -> None:
    """A long message is cut at a word's end with an ellipsis, in the probe and the report;
    a short one is left alone."""
    text = "vLLM failed; for help visit https://docs.vllm.ai/en/latest/usage/troubleshooting"
    assert shorten(text, 200) == text
    cut = shorten(text, 50)
    assert cut == "vLLM failed; for help visit\u2026" and len(cut) <= 50
    error = _kv_probe._error(RuntimeError("word " * 500 + "https://example.invalid/long"),
                             limit=100)
    assert error["message"].endswith("word\u2026") and len(error["message"]) <= 100


def test_a_misspelt_architecture_is_a_usage_error() -> None:
    """An architecture the installed vLLM does not register (no family either) is refused with
    the close match, not judged 'nothing needed'."""
    with pytest.raises(UsageError, match=r"registers no architecture FalconH1ForCausalLN .*"
                                         r"did you mean FalconH1ForCausalLM\?"):
        refuse_unregistered(["FalconH1ForCausalLN"], ["FalconH1ForCausalLM", "LlamaForCausalLM"],
                            "m", "m/config.json")
    refuse_unregistered(["FalconH1ForCausalLM"], ["FalconH1ForCausalLM"], "m", "x")
    refuse_unregistered(["Anything"], None, "m", "x")  # registry unreadable: no judgement


def test_remote_code_config_is_loaded_natively(tmp_path: Path) -> None:
    """A config.json with auto_map is copied without it (JSON files only, no code), so vLLM
    loads its own registered family without running the model's code."""
    model = tmp_path / "nemotron"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
         "auto_map": {"AutoConfig": "configuration_nemotron_h.NemotronHConfig"}}))
    (model / "configuration_nemotron_h.py").write_text("raise SystemExit('remote code ran')\n")
    assert remote_code_of(model) and not remote_code_of(FINETUNE)
    (tmp_path / "scratch").mkdir()
    copy = native_copy(model, tmp_path / "scratch")
    assert sorted(p.name for p in copy.iterdir()) == ["config.json"]
    assert "auto_map" not in json.loads((copy / "config.json").read_text())
    assert json.loads((copy / "config.json").read_text())["model_type"] == "nemotron_h"


def test_config_lines() -> None:
    """The lines select the patches for the architecture vLLM ran, and the model directory."""
    lines = config_lines(("kv-cache-page-unification",), "Qwen3_5MoeForConditionalGeneration",
                         "./models/ft", True)
    assert lines == ("[tool.vllm-patch]", 'models = ["./models/ft"]',
                     "[tool.vllm-patch.architectures.Qwen3_5MoeForConditionalGeneration]",
                     'patches = ["kv-cache-page-unification"]')
    assert config_lines((), "X", "m", True) == ()


@pytest.fixture()
def demo_module() -> types.ModuleType:
    module = types.ModuleType("hvp_doctor_demo")
    exec("class Model:\n    @classmethod\n    def shape(cls):\n        return (3,)\n\n"
         "def unify(x):\n    raise NotImplementedError(x)\n", vars(module))
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_activation_is_undone(demo_module: types.ModuleType) -> None:
    """A block executed into a module (rebinding a function, a classmethod and adding names)
    is active until restored, and afterwards the module and its classes are as before."""
    before_unify, before_shape = demo_module.unify, vars(demo_module.Model)["shape"]
    block = ("_original = unify\n\ndef unify(x):\n    return x\n\n"
             "Model.shape = classmethod(lambda cls: (5,))\nModel.extra = 1\n")
    snapshot = _kv_probe.activate([{"id": "demo", "module": demo_module.__name__,
                                    "source": block}])
    assert demo_module.unify(7) == 7 and demo_module.Model.shape() == (5,)
    snapshot.restore()
    assert demo_module.unify is before_unify and "_original" not in vars(demo_module)
    assert vars(demo_module.Model)["shape"] is before_shape
    assert demo_module.Model.shape() == (3,) and not hasattr(demo_module.Model, "extra")


def test_a_block_that_raises_leaves_nothing_behind(demo_module: types.ModuleType) -> None:
    """A block that fails half way is undone before the error propagates."""
    with pytest.raises(ZeroDivisionError):
        _kv_probe.activate([{"id": "bad", "module": demo_module.__name__,
                             "source": "def unify(x):\n    return 1\n\n1 / 0\n"}])
    with pytest.raises(NotImplementedError):
        demo_module.unify(1)


def _config(**text: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(model_config=types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(**text)))


@pytest.mark.parametrize(("text", "expected"), [
    ({"model_type": "qwen3_next", "num_hidden_layers": 4,
      "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
     [["state"]] * 3 + [["attention"]]),
    ({"model_type": "nemotron_h", "num_hidden_layers": 4,
      "layers_block_type": ["mamba", "mlp", "attention", "moe"]},
     [["state"], [], ["attention"], []]),
    ({"model_type": "zamba2", "num_hidden_layers": 3,
      "layers_block_type": ["mamba", "hybrid", "mamba"]},
     [["state"], ["state", "attention"], ["state"]]),
    ({"model_type": "falcon_h1", "num_hidden_layers": 2,
      "layers_block_type": ["attention", "attention"]},
     [["state", "attention"]] * 2),
    ({"model_type": "bamba", "num_hidden_layers": 3, "attn_layer_indices": [1]},
     [["state"], ["attention"], ["state"]]),
])
def test_layer_kinds_per_family(text: dict[str, object], expected: list[list[str]]) -> None:
    """Which layers hold state and which attention, read from the fields each family's vLLM
    model class reads (Falcon-H1: both in every layer; Zamba2: hybrid layers have both)."""
    assert _kv_probe.layer_kinds(_config(**text)) == expected


def test_layer_kinds_of_a_model_without_layout() -> None:
    """A config with no hybrid layout is an error naming its class."""
    with pytest.raises(ValueError, match="no layer_types"):
        _kv_probe.layer_kinds(_config(model_type="x", num_hidden_layers=2))


def test_environment_without_vllm_exits_1() -> None:
    """An environment without vLLM is named, with the next step, and exits 1."""
    code, out, err = cli("doctor", "--model", str(FINETUNE), "--python", sys.executable)
    assert code == 1
    assert "vllm is not installed in" in err and "pass --python" in err
    assert "Traceback" not in out + err


def test_human_output_reads_in_ten_seconds() -> None:
    """The printed report: the platform step, the installed chain with vLLM's error, one line
    per patch (the same failure said once), the cost table, the verdict and the lines."""
    from hatch_vllm_patch.doctor import DoctorReport, DoctorRequest
    from hatch_vllm_patch.doctor.render import print_report as _print_doctor
    from hatch_vllm_patch.environment import TargetEnvironment

    env = TargetEnvironment(Path("/venv/bin/python"), "given with --python", "/venv/bin/python",
                            "/venv", "3.11.7", Path("/venv/lib/python3.11/site-packages"))
    failed = Step("page unification", False, "NotImplementedError: not divisible")
    installed = Run(INSTALLED, (), (Step("config", True), failed), failed, None,
                    platform="CpuPlatform.update_block_size_for_backend: 16 -> 16 tokens",
                    max_model_len=32768)
    fixed = Run("kv", ("kv",), (Step("config", True), Step("page unification", True)), None,
                Cost(1081344, 1073152, 1056, 99, 85369, 20.89, ()))
    same = Run("other", ("other",), installed.steps, failed, None)
    report = DoctorReport(env, "0.20.2", DoctorRequest(model="m", platform="cpu",
                                                       kv_cache_memory=8 << 30),
                          Path("/models/m"), "Arch", (installed, same, fixed), ("other", "kv"),
                          (), ("kv",), config_lines(("kv",), "Arch", "m", True),
                          "does not start as installed (page unification); kv fixes it",
                          neuron_note="Neuron: the vllm-neuron plugin is not installed here")
    out = io.StringIO()
    _print_doctor(report, out)
    text = out.getvalue()
    assert text.splitlines()[0] == ("vLLM 0.20.2 (/venv/bin/python), CPU path: "
                                    "CpuPlatform.update_block_size_for_backend: 16 -> 16 tokens")
    assert "as installed: config > page unification FAILED\n  NotImplementedError: not " \
        "divisible\n" in text
    assert "with other: fails at page unification (the same)\n" in text
    assert "with kv: starts\n" in text
    assert "8192 B (0.76%)" in text and "20.89x" in text and "max_model_len 32768" in text
    assert ("CPU path: tokens/GiB follow the CPU platform's block rule (1056-token attention "
            "blocks beside the state pages here)") in text
    assert text.rstrip().endswith('[tool.vllm-patch.architectures.Arch]\n  patches = ["kv"]')
    assert len(text.splitlines()) <= 16


def _planned(name: str, patches: tuple[str, ...], bytes_per_request: int) -> Run:
    cost = _cost(1024)._replace(bytes_per_request=bytes_per_request)
    return _run(name, patches, cost=cost)._replace(max_model_len=4096)


QWEN36_FACTS = {"attention_bytes_per_token": 1024, "attention_layers": 10,
                "state_bytes": 1073152, "state_layers": 30, "state_blocks_per_request": 2,
                "draft_page": None}


def test_memory_advice_recommends_a_patch_that_holds_more() -> None:
    """A memory patch holding more tokens per GiB than the installed plan is recommended with
    its gain; one holding the same is not; the minimum comes from the formula."""
    from hatch_vllm_patch.doctor import GIB, memory_advice, minimum_plan

    best = minimum_plan(QWEN36_FACTS, 16, 4096)
    assert best == {"page": 1081344, "bytes_per_request": 100 * 1081344}
    runs = [_planned(INSTALLED, (), best["bytes_per_request"] * 2),
            _planned("promote", ("promote",), best["bytes_per_request"]),
            _planned("same", ("same",), best["bytes_per_request"] * 2)]
    advice = memory_advice(runs, ["promote", "same"], QWEN36_FACTS, "cuda")
    assert advice is not None
    tokens = GIB * 4096 // best["bytes_per_request"]
    assert (advice.installed, advice.minimum) == (tokens // 2, tokens)
    assert advice.recommended == ("promote",)
    assert advice.line == (f"promote: +100% tokens per GiB ({tokens // 2:,} \u2192 {tokens:,}); "
                           f"the minimum holds {tokens:,}")
    more_groups = _planned("regroup", ("regroup",), best["bytes_per_request"])
    more_groups = more_groups._replace(cost=more_groups.cost._replace(groups=("g",) * 41))
    regrouped = memory_advice([*runs, more_groups], ["promote", "same", "regroup"],
                              QWEN36_FACTS, "cuda")
    assert regrouped is not None and regrouped.recommended == ("promote", "regroup")
    assert (f"regroup: +100% tokens per GiB ({tokens // 2:,} \u2192 {tokens:,}), at a cost: 41 "
            "KV cache groups instead of 1: vLLM works per group every step, generate time "
            "1.03x at 4 \u2192 41 groups") in regrouped.line
    assert "; worth it" not in regrouped.line and "((" not in regrouped.line
    # a patch of the planning that was not tried is named only where nothing tried reaches
    # the minimum
    short = memory_advice(runs[:1] + runs[2:], ["same"], QWEN36_FACTS, "cuda",
                          untried=["exact"])
    assert short is not None and short.line.endswith(
        "; not tried, selected by id only: exact (`--all` tries it)")
    assert memory_advice(runs, ["promote", "same"], QWEN36_FACTS, "cuda",
                         untried=["exact"]) == advice
    quiet = memory_advice(runs[:1] + runs[2:], ["same"], QWEN36_FACTS, "cuda")
    assert quiet is not None and quiet.recommended == ()
    assert quiet.line.startswith("same changes nothing here:")
    assert memory_advice([_run(INSTALLED, (), fails="grouping")], [], None, "cuda") is None


def test_relative_model_from_a_subfolder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor names `../models/x` for `--model models/x` typed in a subfolder, never a download."""
    (tmp_path / ".git").mkdir()
    (tmp_path / "models" / "x").mkdir(parents=True)
    (tmp_path / "models" / "x" / "config.json").write_text("{}")
    (tmp_path / "service").mkdir()
    monkeypatch.chdir(tmp_path / "service")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UsageError, match=r"\.\./models/x is a model directory") as info:
        resolve_model("models/x")
    assert "hf download" not in str(info.value)


def test_inspection_cause_names_the_failing_import(tmp_path: Path) -> None:
    """A Qwen3.5 class vLLM could not inspect: the note names `import torchvision`, the error
    and the fix (a stand-in torchvision that fails to import plays the broken one)."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                   check=True)
    python = tmp_path / "venv" / "bin" / "python"
    site = next((tmp_path / "venv" / "lib").glob("python3*/site-packages"))
    (site / "torchvision").mkdir()
    (site / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    note = inspection_cause(python, "Qwen3_5MoeForConditionalGeneration", None, 60)
    assert note.startswith("vLLM could not inspect Qwen3_5MoeForConditionalGeneration: "
                           "`import torchvision` fails")
    assert "torchvision::nms does not exist" in note
    assert "docs/how-to/cpu-build.md" in note
    other = inspection_cause(python, "JambaForCausalLM", "vllm.model_executor.models.jamba", 60)
    assert "import vllm.model_executor.models.jamba" in other


def test_memory_verdict_is_one_with_its_cost_and_tries_the_planning_patches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --all, the patches of vLLM's KV planning that name no architecture (exact
    groups) are tried alone, never in the together run; where one holds more tokens the
    verdict says so with its group count and step-time cost beside the gain (no "optional"),
    and the table shows the memory line's figure for each state, not a second one."""
    from hatch_vllm_patch.catalog import load_catalog
    from hatch_vllm_patch.doctor import DoctorRequest, diagnose
    from hatch_vllm_patch.doctor import run as doctor_run
    from hatch_vllm_patch.doctor.render import print_report as _print_doctor
    from hatch_vllm_patch.engine import Verdict
    from hatch_vllm_patch.environment import TargetEnvironment

    arch = "Qwen3_5MoeForConditionalGeneration"
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": [arch],
                                                   "model_type": "qwen3_5_moe"}))
    catalog = load_catalog()
    ids = ("kv-cache-uneven-groups", "kv-cache-exact-groups")
    jobs: list[dict[str, object]] = []
    best = 100 * 1081344  # minimum_plan(QWEN36_FACTS, 16, 4096): 40,672 tokens per GiB
    per_request = {"installed": 2 * best, "kv-cache-uneven-groups": 2 * best,
                   "kv-cache-exact-groups": best}
    groups = {"kv-cache-exact-groups": 41}

    def child(python: Path, job: dict[str, object], **_: object) -> dict[str, object]:
        jobs.append(job)
        variants = {}
        for v in job["cases"][0]["variants"]:  # type: ignore[index]
            name = v["name"]
            variants[name] = {
                "steps": [{"step": "config", "ok": True, "detail": {"max_model_len": 4096}}],
                "kv": {"pages": [1081344], "num_blocks_per_gib": 99, "tokens_per_gib": 62686,
                       "bytes_per_request": per_request[name],
                       "groups": [{"type": "FullAttentionSpec", "layers": 1,
                                   "block_size": 16}] * groups.get(name, 4)},
                "facts": {**QWEN36_FACTS, "state_bytes": 1073152}}
        return {"vllm": "0.33.0", "cases": [{"variants": variants}]}

    monkeypatch.setattr(doctor_run, "run_child", child)  # the module that calls it
    env = TargetEnvironment(Path("/venv/bin/python"), "given with --python",
                            "/venv/bin/python", "/venv", "3.11.7",
                            Path("/venv/lib/python3.11/site-packages"))
    report = diagnose(DoctorRequest(model=str(model)), env, catalog,
                      {pid: Verdict.MISSING for pid in ids}, [arch])
    [job] = jobs
    tried = [v["name"] for v in job["cases"][0]["variants"]]  # type: ignore[index]
    assert tried == ["installed", "kv-cache-uneven-groups", "kv-cache-exact-groups"], tried
    assert report.memory is not None and report.memory.recommended == ("kv-cache-exact-groups",)
    assert report.verdict.startswith(
        "starts as installed: nothing needed to start; for memory, recommended: "
        "kv-cache-exact-groups: +100% tokens per GiB (20,336 \u2192 40,672), at a cost: 41 KV "
        "cache groups instead of 4: vLLM works per group every step"), report.verdict
    assert "optional" not in report.verdict and "not tried" not in report.memory.line
    out = io.StringIO()
    _print_doctor(report, out)
    text = out.getvalue()
    assert "62,686" not in text and "62686" not in text, text
    rows = [line.split() for line in text.splitlines() if line.startswith("  as installed")
            or line.startswith("  with kv-cache-exact-groups")]
    assert [(row[-3], row[-1]) for row in rows] == [("4", "20,336"), ("41", "40,672")], text
    assert text.count("at a cost: 41 KV cache groups") == 1, text  # said once: the verdict
    assert "as installed 20,336; with kv-cache-uneven-groups 20,336; with " \
        "kv-cache-exact-groups 40,672; minimum 40,672" in text, text
