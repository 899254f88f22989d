"""lm-eval glue: evaluate a model object on one task and return the gated metric plus every sample's greedy output."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from .config import TaskSpec
from .gate import Score


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    """The local task YAMLs name their data relative to the repository root (a YAML cannot name a path relative
    to itself), so lm-eval runs from there."""
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def task_manager(task_dirs: list[Path]):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(d) for d in task_dirs] or None)


def wrap(model: nn.Module, tokenizer, batch_size: int, max_length: int | None = None):
    """An lm-eval HFLM around an already-built model (lm-eval then takes its device from the model)."""
    from lm_eval.models.huggingface import HFLM

    kwargs = {"max_length": max_length} if max_length else {}
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)


def greedy_outputs(samples: list[dict]) -> tuple:
    """Per doc (in doc order): the generated text, or the index of the highest-log-likelihood choice."""
    by_doc: dict[int, object] = {}
    for sample in samples:
        if sample["doc_id"] in by_doc:  # one entry per filter: the raw response is the same in each
            continue
        resps = sample["resps"]
        if resps and isinstance(resps[0][0], str):
            by_doc[sample["doc_id"]] = resps[0][0]
        else:  # multiple choice: one (log-likelihood, is_greedy) pair per choice
            lls = [r[0][0] for r in resps]
            by_doc[sample["doc_id"]] = max(range(len(lls)), key=lls.__getitem__)
    return tuple(by_doc[d] for d in sorted(by_doc))


def evaluate(lm, task: TaskSpec, manager, limit: int | None, root: Path) -> Score:
    """One lm-eval run of `task` (its own limit unless `limit` is given); lm-eval's progress bars stay visible."""
    import lm_eval

    with working_directory(root):
        out = lm_eval.simple_evaluate(
            model=lm, tasks=[task.name], num_fewshot=task.num_fewshot, limit=limit or task.limit,
            task_manager=manager, log_samples=True,
        )
    result = out["results"][task.name]
    if task.metric not in result:
        metrics = sorted(k for k in result if "," in k and "_stderr" not in k)
        raise KeyError(f"task {task.name} reported no {task.metric!r}; it has {metrics}")
    stderr = result.get(task.stderr_key)
    greedy = greedy_outputs(out["samples"][task.name])
    return Score(float(result[task.metric]), float(stderr) if isinstance(stderr, (int, float)) else 0.0,
                 len(greedy), greedy)
