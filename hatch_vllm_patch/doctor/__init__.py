"""``vllm-patch doctor``: will this model start on the installed vLLM, and which patch does it need.

The answer comes from vLLM's own code in the target environment (``_kv_probe.py``, run by the
target interpreter on CPU, offline, without weights): the start-up steps as installed, then the
same steps with each catalog or project patch that applies to this vLLM and is not in place
executed into the imported modules of that child process only (nothing is written), and with
all of them together. The package prepares the job, runs the child and judges its answer; the
CLI prints it.

The package's modules are its judgements: ``report``, ``inputs``, ``job``, ``startup``,
``neuron``, ``runtime``, ``memory``, ``prefix``, ``model_folder``, ``run``.
"""

from __future__ import annotations

from .inputs import (
    GPUS,
    attention_backend_names,
    check_backend_name,
    check_path_options,
    parse_gpu,
    parse_json_object,
    parse_memory,
    resolve_model,
    vllm_backend_choice,
)
from .job import (
    blocks_of,
    case_of,
    combined,
    compatible,
    concerns,
    modelled_of,
    run_child,
    variants,
)
from .memory import memory_advice, minimum_plan, tokens_per_gib
from .model_folder import (
    MAX_NATIVE_FILE,
    inspection_cause,
    native_copy,
    refuse_unregistered,
    remote_code_of,
    unregistered_override,
)
from .prefix import PREFIX_BUGS, PrefixVerdict, judge_prefix
from .report import (
    ALL_TOGETHER,
    GIB,
    INSTALLED,
    RECOMMENDED,
    Cost,
    DoctorReport,
    DoctorRequest,
    Gpu,
    MemoryAdvice,
    Modelled,
    NeuronBudget,
    Run,
    RuntimeAdvice,
    Step,
)
from .run import catalog_status, diagnose, run_doctor, run_doctor_many
from .runtime import runtime_advice
from .startup import config_lines, judge, shorten

__all__ = [
    "ALL_TOGETHER", "GIB", "GPUS", "INSTALLED", "MAX_NATIVE_FILE", "PREFIX_BUGS", "RECOMMENDED",
    "Cost", "DoctorReport", "DoctorRequest", "Gpu", "MemoryAdvice", "Modelled", "NeuronBudget",
    "PrefixVerdict", "Run", "RuntimeAdvice", "Step", "attention_backend_names", "blocks_of",
    "case_of", "catalog_status", "check_backend_name", "check_path_options", "combined",
    "compatible", "concerns", "config_lines", "diagnose", "inspection_cause", "judge",
    "judge_prefix", "memory_advice", "minimum_plan", "modelled_of", "native_copy", "parse_gpu",
    "parse_json_object", "parse_memory", "refuse_unregistered", "remote_code_of",
    "resolve_model", "run_child", "run_doctor", "run_doctor_many", "runtime_advice", "shorten",
    "tokens_per_gib", "unregistered_override", "variants", "vllm_backend_choice",
]
