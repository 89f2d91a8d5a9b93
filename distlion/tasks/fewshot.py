"""Few-shot evaluation of a language model through lm-evaluation-harness (`lm_eval.simple_evaluate` with its
`HFLM` wrapping the model and tokenizer in memory), as the paper's third table evaluates its finetunes.

`eval.tasks` names lm-eval tasks (the paper's, `PAPER_TASKS`: its SIQA is lm-eval's social_iqa; their data from
the Hugging Face cache, or the hub when online) or this repository's local ones,
which need no download: lm-eval task YAML files in `fewshot/` whose documents are built here, deterministically,
from the run's **test** text (held out from every training split; for Tiny Shakespeare the data's own
validation file):

- `nextline` (HellaSwag-style): 4 consecutive lines of a passage; choose its next line among it and 3 lines of
  about its length from elsewhere in the same text.
- `lastword` (LAMBADA-style): a passage of 3 lines without its last word; choose that word among it and 3
  words of its length and case that end other lines of the same text.

Distractors are drawn by occurrence from the population the answers come from, so a scorer blind to the context
(word frequency, length, an untrained model) is at chance.

Both have 4 choices (chance 25%); `fewshot_chance_<task>` is reported beside each score. The few-shot examples
come from a pool of passages disjoint from the scored ones.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from distlion.tasks.data import atomic_write_text, cache_dir
from distlion.tasks.tokenizer import text_digest

TASK_FILES = Path(__file__).resolve().parent / "fewshot"
#: The paper's 3-shot tasks by their lm-eval names: eval.tasks=[arc_easy,arc_challenge,boolq,piqa,social_iqa,...]
PAPER_TASKS = ("arc_easy", "arc_challenge", "boolq", "piqa", "social_iqa", "hellaswag", "openbookqa")
CHOICES = 4
POOL = 32  # passages kept for few-shot examples, never scored
MIN_LINE = 16  # characters of a `nextline` answer: not a speaker's name or a fragment
LAST_WORD = re.compile(r" ([A-Za-z]{3,})[^A-Za-z]*$")  # a word of 3+ letters after a space, ending a line


def _nonblank_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def _distractors(candidates: list[str], target: str, count: int, rng: random.Random,
                 same: Callable[[str, str], bool]) -> list[str] | None:
    """`count` distinct candidates unlike `target` for which `same(candidate, target)` holds, or None.

    Drawn by occurrence from `candidates`, a sample of the population the answers come from, so the answer and
    its distractors are exchangeable: a scorer that ignores the context (word frequency, length, the token count
    an untrained model's likelihood follows) is at chance. Drawing from the distinct values instead favours rare
    ones, and an untrained model then scored 42% on `lastword` against 25% chance."""
    pool = [c for c in candidates if c != target and same(c, target)]
    if len(set(pool)) < count:
        return None
    chosen: list[str] = []
    while len(chosen) < count:
        candidate = rng.choice(pool)
        if candidate not in chosen:
            chosen.append(candidate)
    return chosen


def nextline_docs(text: str, seed: int = 0) -> list[dict[str, Any]]:
    """Passages of 4 lines + the true next line (of at least `MIN_LINE` characters), non-overlapping, in text
    order; the distractors are lines of about its length, and as long as an answer may be."""
    lines, rng, docs = _nonblank_lines(text), random.Random(seed), []
    for start in range(0, len(lines) - 5, 5):
        context, answer = lines[start : start + 4], lines[start + 4]
        if len(answer) < MIN_LINE:
            continue
        far = lines[: max(0, start - 50)] + lines[start + 55 :]  # not from the passage's neighbourhood
        wrong = _distractors(far, answer, CHOICES - 1, rng,
                             lambda c, t: len(c) >= MIN_LINE and abs(len(c) - len(t)) <= max(3, len(t) // 5))
        if wrong is None:
            continue
        choices = [answer, *wrong]
        rng.shuffle(choices)
        docs.append({"context": "\n".join(context), "choices": choices, "label": choices.index(answer)})
    return docs


def lastword_docs(text: str, seed: int = 0) -> list[dict[str, Any]]:
    """Passages of 3 lines whose last word (letters only, at least 3, after a space) is held out, non-overlapping;
    none that ends in a speaker's name. The distractors are last words of other lines, of its length and case."""
    lines, rng, docs = _nonblank_lines(text), random.Random(seed), []
    words = [m.group(1) for line in lines if not line.endswith(":") and (m := LAST_WORD.search(line))]
    for start in range(0, len(lines) - 3, 3):
        passage = "\n".join(lines[start : start + 3])
        match = LAST_WORD.search(passage)
        if match is None or lines[start + 2].endswith(":"):  # not a speaker's name
            continue
        answer = match.group(1)
        wrong = _distractors(words, answer, CHOICES - 1, rng,
                             lambda c, t: len(c) == len(t) and c[0].isupper() == t[0].isupper())
        if wrong is None:
            continue
        choices = [answer, *wrong]
        rng.shuffle(choices)
        docs.append({"context": passage[: match.start(1)].rstrip(), "choices": choices,
                     "label": choices.index(answer)})
    return docs


LOCAL_TASKS: dict[str, Callable[[str], list[dict[str, Any]]]] = {"nextline": nextline_docs, "lastword": lastword_docs}


def local_task_config(name: str, text: str) -> dict[str, Any]:
    """The lm-eval config of local task `name` (its YAML in `fewshot/`) with its documents built from `text`:
    a few-shot pool (lm-eval's train split: the first `POOL` passages of a seeded shuffle) and the scored rest
    (its test split), as JSON lines cached by text and task."""
    docs = LOCAL_TASKS[name](text)
    random.Random(1).shuffle(docs)
    if len(docs) < POOL + 10:
        raise ValueError(f"few-shot task {name}: the test text makes only {len(docs)} passages, fewer than "
                         f"{POOL + 10}; use a longer test split")
    folder = cache_dir("fewshot") / f"{name}-{text_digest([json.dumps(docs)])}"  # named by content: never stale
    files = {}
    for split, part in (("train", docs[:POOL]), ("test", docs[POOL:])):
        files[split] = folder / f"{split}.jsonl"
        if not files[split].exists():
            atomic_write_text(files[split], "".join(json.dumps(d) + "\n" for d in part))
    config = yaml.safe_load((TASK_FILES / f"{name}.yaml").read_text())
    config["dataset_kwargs"] = {"data_files": {split: str(path) for split, path in files.items()}}
    return config


def evaluate_fewshot(model: nn.Module, tokenizer: Any, tasks: list[str], test_text: str, num_fewshot: int,
                     limit: int | None = None, batch_size: int = 16, max_length: int = 256) -> dict[str, float]:
    """Accuracy (and length-normalised accuracy) ± stderr of each task, keys `fewshot_<metric>_<task>`, plus
    `fewshot_chance_<task>` for the local tasks. `tokenizer`: a transformers tokenizer."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager()
    was_training = model.training
    model.eval()
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(next(model.parameters()).device),
              max_length=max_length)
    out: dict[str, float] = {}
    try:
        for name in tasks:
            if name in LOCAL_TASKS:
                task: str | dict[str, Any] = local_task_config(name, test_text)
                out[f"fewshot_chance_{name}"] = 1 / CHOICES
            elif name in manager.all_tasks:
                task = name
            else:
                raise ValueError(f"few-shot task {name!r} is neither local ({', '.join(LOCAL_TASKS)}) nor an lm-eval "
                                 "task name (e.g. arc_easy, hellaswag)")
            try:
                with torch.no_grad():
                    results = lm_eval.simple_evaluate(
                        model=lm, tasks=[task], num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                        log_samples=False, verbosity="ERROR", random_seed=0, numpy_random_seed=0,
                        torch_random_seed=0, fewshot_random_seed=0)
            except (ConnectionError, OSError) as err:  # the data set: not cached, and no hub to fetch it from
                raise FileNotFoundError(
                    f"few-shot task {name}: its data set could not be loaded ({type(err).__name__}); lm-eval reads it "
                    "from the Hugging Face datasets cache (HF_DATASETS_CACHE, default ~/.cache/huggingface/datasets) "
                    "or the hub when online; fetch it on a machine with internet, or evaluate local tasks "
                    f"({', '.join(LOCAL_TASKS)})") from None
            scores = results["results"].get(name)
            if scores is None:
                raise ValueError(f"few-shot task {name!r} is a group of lm-eval tasks without one score; name its "
                                 f"tasks: {', '.join(sorted(results['results']))}")
            for metric in ("acc", "acc_norm"):
                if f"{metric},none" in scores:
                    out[f"fewshot_{metric}_{name}"] = float(scores[f"{metric},none"])
                    out[f"fewshot_{metric}_stderr_{name}"] = float(scores[f"{metric}_stderr,none"])
    finally:
        model.train(was_training)
    return out


def main() -> None:
    """`python -m distlion.tasks.fewshot <model folder>`: the few-shot scores of a saved model (or, with
    `--untrained`, of a freshly initialised model of the same architecture: the chance baseline) on a task's test
    text, as JSON; e.g. the pretrained model before any finetune."""
    import argparse

    from hydra import compose, initialize_config_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    from distlion.tasks import TASK_CONFIGS, build_task
    from distlion.tasks.lm import load_llama

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model", help="a folder written by save_pretrained (train.save_model=true: <run dir>/model)")
    parser.add_argument("--task", default="shakespeare_finetune", help="whose test text the local tasks are built from")
    parser.add_argument("--tasks", nargs="+", default=list(LOCAL_TASKS))
    parser.add_argument("--num-fewshot", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--untrained", action="store_true", help="a random init of the model's architecture")
    parser.add_argument("--seed", type=int, default=0, help="of the random init")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    with initialize_config_dir(config_dir=str(TASK_CONFIGS.parent), version_base="1.3"):
        cfg = compose("config", overrides=[f"task={args.task}", "model=llama_pretrained",
                                           f"model.pretrained={Path(args.model).resolve()}"])
    task = build_task(cfg.task, cfg.model)
    if args.untrained:
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(args.model))
    else:
        model = load_llama(args.model)
    scores = task.fewshot(model, args.tasks, args.num_fewshot, args.limit)
    text = json.dumps({"model": str(args.model), "untrained": args.untrained, "task": args.task,
                       "num_fewshot": args.num_fewshot, "limit": args.limit, **scores}, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
