"""lm-evaluation-harness against the stack and against the checkpoint it serves.

Two tasks of lm-eval's own YAML format over data generated here from the default
model's word banks (no hub: the data files are local JSON lines): a multiple-choice
task, scored by log-likelihoods (``echo``, ``logprobs: 1``, ``max_tokens: 1`` on
``/v1/completions``), whose continuations end a sentence, so that the token the stack
generates after many of them is the end token; and ``generate_until`` items, greedy.
:func:`evaluate` runs lm-eval's command line as users do, with ``local-completions``
(tokenized requests, the checkpoint's tokenizer) or with its ``hf`` model.
"""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

from build_engines.corpus import OBJECTS, PLACES, SUBJECTS, VERBS

CHOICE_TASK, GENERATE_TASK = "tritonllm_choice", "tritonllm_generate"

_CHOICE_YAML = """\
task: tritonllm_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""

_GENERATE_YAML = """\
task: tritonllm_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA
test_split: test
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(directory: Path, questions: int = 100, generations: int = 12) -> Path:
    """The two tasks' YAML and data in ``directory`` (lm-eval's ``--include_path``)."""
    rng = random.Random(0)
    directory.mkdir(parents=True, exist_ok=True)
    choices = []
    for _ in range(questions):
        subject, verb, thing = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
        # lm-eval puts a space between context and choice. Most choices end the sentence:
        # the model's next token is then often its end token, the token lm-eval's
        # requests generate and drop.
        ends = [rng.choice([".", ".", "?", ""]) for _ in range(4)]
        options = [place + end for place, end in zip(rng.sample(PLACES, 4), ends, strict=True)]
        context = f"{subject.capitalize()} {verb} {thing}"
        choices.append({"context": context, "choices": options, "answer": rng.randrange(4)})
    prompts = [
        {"context": f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)}", "target": ""}
        for _ in range(generations)
    ]
    for name, docs, template in (
        (CHOICE_TASK, choices, _CHOICE_YAML),
        (GENERATE_TASK, prompts, _GENERATE_YAML),
    ):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (directory / f"{name}.yaml").write_text(template.replace("DATA", str(data)))
    return directory


@dataclass(frozen=True)
class Evaluation:
    """One lm-eval run: each task's metrics and each request's answer, in document order."""

    results: dict  # task -> lm-eval's metrics
    log_likelihoods: list[float]  # the choice task's, every (document, choice) in order
    generations: list[str]  # the generate task's


def evaluate(lm_eval: Path, tasks: Path, output: Path, model: str, model_args: str) -> Evaluation:
    """lm-eval's command line (``lm_eval run``) over both tasks, samples logged."""
    command = [
        str(lm_eval),
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        f"{CHOICE_TASK},{GENERATE_TASK}",
        "--include_path",
        str(tasks),
        "--output_path",
        str(output),
        "--log_samples",
        "--batch_size",
        "1",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    (results,) = output.rglob("results_*.json")
    return Evaluation(
        results=json.loads(results.read_text())["results"],
        # Each request's answer: [[log-likelihood, is greedy]], as text.
        log_likelihoods=[float(r[0][0]) for s in _samples(output, CHOICE_TASK) for r in s["resps"]],
        generations=[s["resps"][0][0] for s in _samples(output, GENERATE_TASK)],
    )


def _samples(output: Path, task: str) -> list[dict]:
    (path,) = output.rglob(f"samples_{task}_*.jsonl")
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(samples, key=lambda sample: sample["doc_id"])
