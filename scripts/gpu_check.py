"""The checks only a machine with a CUDA device can make (issue 38), run by `scripts/gpu_check.sh`; see there.

    python3 scripts/gpu_check.py [--device cuda|cpu] [--out DIR] [--budget S] [--jobs J] [--methods a,b]

Every run is `python3 -m distlion.train` (or `python3 -m torch.distributed.run` of it) on the digits task, 20 steps,
`logger=none`, in a work folder outside any `runs/` (so that no run is copied from a finished twin); up to J of them
at once, at most `--gpu-jobs` on the GPU. The checks, each PASS, FAIL, or "not run" when the budget ran out:

- every registered method, 20 steps simulated with N=4 on the device (methods that only run under torchrun, the
  DDP ones: a 1-rank torchrun there): it finishes; its bits equal a CPU run's for fixed-size payloads, and for every
  method the bits of its messages built on the device satisfy its registry formula (`probe`); its final train loss
  lies in [min - std, max + std] of three CPU seeds' (run on this machine's CPU, in the same script);
- D-Lion MaVo and Avg under torchrun over NCCL (1 rank, 2 where there are 2 GPUs) end bitwise where the simulated
  cluster on the same device does, under `torch.use_deterministic_algorithms(True)`, `grad_strategy=sequential`;
- `train.amp=bf16 train.compile=true` trains; a run killed by SIGKILL after a checkpoint resumes bitwise;
- the fused D-Lion kernels pass their check at load on the device; the CUDA unit tests pass;
- the GPU bench rows (benchmarks/bench_gpu.py), measured first, alone on the machine.

`--device cpu` is the dry run for a machine without a GPU: the same jobs on the CPU, torchrun over gloo, and an
import guard that makes the packages the GPU machine lacks unimportable. Internal entry points (also used by the
jobs): `gpu_check.py train [--deterministic] [--kill-after-checkpoint K] -- OVERRIDES`, `probe`, `bench`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # distlion is not installed on the GPU machine

STEPS = 20
WORKERS = 4
SEEDS = (0, 1, 2)
COMMON = ["task=digits", "logger=none", "train.progress=false", f"train.steps={STEPS}", f"train.eval_every={STEPS}",
          "train.threads=1", "experiment=gpu_check"]
DETERMINISTIC = ("dlion", "dlion_avg")
#: Settings a method needs to run 20 steps (2.5 epochs of digits at N=4): DGC's sparsity warm-up must end in the run.
FITS_THE_RUN = {"dgc": ["method.warmup_epochs=1"]}
#: What the GPU machine lacks (besides what .whl/ brings): the dry run makes them unimportable, so that a digits
#: run that needed one fails here first. (torchvision is there: timm imports it unconditionally.)
ABSENT_THERE = ("wandb", "datasets", "dill", "multiprocess", "submitit", "hydra_plugins", "lm_eval")
CUDA_TESTS = ("tests/test_packing.py", "tests/test_torchdist.py", "tests/test_kernels_triton.py",
              "tests/test_device.py")


# --------------------------------------------------------------------------------------------------
# Jobs: processes run side by side, each with a log


@dataclass
class Job:
    name: str
    argvs: list[list[str]]  # run one after the other (the killed run, then its resume)
    gpu: bool = False
    timeout: float = 240.0
    env: dict[str, str] = field(default_factory=dict)
    returncodes: list[int | None] = field(default_factory=list)
    seconds: float = 0.0
    log: Path | None = None
    skipped: str = ""

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""


class Runner:
    """Runs jobs on `workers` threads, at most `gpu_slots` GPU jobs at once, none started past the deadline; a job
    past its time limit is killed with its process group (torchrun's ranks included)."""

    def __init__(self, logs: Path, workers: int, gpu_slots: int, deadline: float, env: dict[str, str]):
        self.logs, self.workers, self.deadline, self.env = logs, workers, deadline, env
        self.gpu = threading.Semaphore(gpu_slots)

    def run(self, jobs: list[Job]) -> None:
        with ThreadPoolExecutor(self.workers) as pool:
            for future in [pool.submit(self._run, job) for job in jobs]:
                future.result()

    def _run(self, job: Job) -> None:
        job.log = self.logs / f"{job.name}.log"
        with self.gpu if job.gpu else contextlib.nullcontext():
            start = time.time()
            for argv in job.argvs:
                left = self.deadline - time.time()
                if left < 5:
                    job.skipped = "not run: out of time"
                    break
                job.returncodes.append(self._process(job, argv, min(job.timeout, left)))
            job.seconds = time.time() - start
        print(f"gpu_check: {job.name}: {job.returncodes or job.skipped} in {job.seconds:.0f} s", flush=True)

    def _process(self, job: Job, argv: list[str], timeout: float) -> int | None:
        with open(job.log, "a") as log:
            log.write(f"$ {' '.join(argv)}\n")
            log.flush()
            process = subprocess.Popen(argv, cwd=REPO, env={**self.env, **job.env}, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the group this job started, torchrun's ranks with it
                process.wait()
                log.write(f"gpu_check: killed after {timeout:.0f} s\n")
                return None


# --------------------------------------------------------------------------------------------------
# The jobs of a check


@dataclass
class Plan:
    py: str
    device: str  # cuda | cpu
    work: Path
    ranks: int  # torchrun ranks of the deterministic comparison
    jobs: list[Job] = field(default_factory=list)

    def train(self, *overrides: str, run_dir: Path, sweep: bool = False) -> list[str]:
        where = f"hydra.sweep.dir={run_dir}" if sweep else f"hydra.run.dir={run_dir}"
        return [self.py, "-m", "distlion.train", *(["-m"] if sweep else []), *COMMON, *overrides, where]

    def wrapped(self, *overrides: str, run_dir: Path, ranks: int = 0, options: tuple[str, ...] = ()) -> list[str]:
        """A run through `gpu_check.py train` (deterministic algorithms, a kill), under torchrun with `ranks`."""
        launch = [self.py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks else \
            [self.py]
        return [*launch, str(Path(__file__).resolve()), "train", *options, "--", *COMMON, *overrides,
                f"hydra.run.dir={run_dir}"]

    def torchrun(self, *overrides: str, run_dir: Path, ranks: int = 1) -> list[str]:
        return [self.py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m",
                "distlion.train", "cluster=torchdist", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]


def plan(py: str, device: str, work: Path, methods: list[str], ranks: int) -> Plan:
    from distlion.methods import METHODS

    p = Plan(py, device, work, ranks)
    on = f"train.device={device}"
    backend = "nccl" if device == "cuda" else "gloo"
    dev_gpu = device == "cuda"
    p.jobs.append(Job("amp_compile", [p.train("method=dlion", on, "train.amp=bf16", "train.compile=true",
                                              "cluster.grad_strategy=sequential", run_dir=work / "amp_compile")],
                      gpu=dev_gpu, timeout=280))
    for name in methods:
        fit = FITS_THE_RUN.get(name, [])
        if "simulated" in METHODS[name].cls.backends:
            p.jobs.append(Job(f"device_{name}", [p.train(f"method={name}", *fit, on, f"cluster.workers={WORKERS}",
                                                         run_dir=work / "device" / name)], gpu=dev_gpu))
            p.jobs.append(Job(f"cpu_{name}", [p.train(f"method={name}", *fit, "train.device=cpu",
                                                      f"cluster.workers={WORKERS}",
                                                      f"seed={','.join(map(str, SEEDS))}", run_dir=work / "cpu" / name,
                                                      sweep=True)]))
        else:  # DDP: one process per worker; on the CPU a world of one needs no torchrun, and a sweep reuses it
            p.jobs.append(Job(f"device_{name}", [p.torchrun(f"method={name}", *fit, on,
                                                               f"cluster.dist_backend={backend}",
                                                               run_dir=work / "device" / name)], gpu=dev_gpu))
            p.jobs.append(Job(f"cpu_{name}", [p.train(f"method={name}", *fit, "cluster=torchdist", "train.device=cpu",
                                                      "cluster.dist_backend=gloo", f"seed={','.join(map(str, SEEDS))}",
                                                      run_dir=work / "cpu" / name, sweep=True)]))
    for name in DETERMINISTIC:
        same = ("cluster.grad_strategy=sequential", f"method={name}", on)
        over = ("cluster=torchdist", f"cluster.dist_backend={backend}")
        p.jobs.append(Job(f"torchrun_{name}", [p.wrapped(*same, *over, run_dir=work / "torchrun" / name,
                                                            ranks=ranks, options=("--deterministic",))], gpu=dev_gpu))
        p.jobs.append(Job(f"simulated_{name}", [p.wrapped(*same, f"cluster.workers={ranks}",
                                                          run_dir=work / "simulated" / name,
                                                          options=("--deterministic",))], gpu=dev_gpu))
    resume = ("method=dlion", on, "train.checkpoint_every=5", f"cluster.workers={WORKERS}")
    p.jobs.append(Job("resume_reference", [p.wrapped(*resume, run_dir=work / "resume" / "reference",
                                                     options=("--deterministic",))], gpu=dev_gpu))
    p.jobs.append(Job("resume_killed", [p.wrapped(*resume, run_dir=work / "resume" / "killed",
                                                  options=("--deterministic", "--kill-after-checkpoint", "10")),
                                        p.wrapped(*resume, run_dir=work / "resume" / "killed",
                                                  options=("--deterministic",))], gpu=dev_gpu))
    # Across devices: checkpointed on one, killed, resumed on the other (and back).
    for first, then in sorted({("cpu", device), (device, "cpu")}):  # (the dry run: one, cpu to cpu)
        moved = ("method=dlion", "train.checkpoint_every=5", f"cluster.workers={WORKERS}")
        folder = work / "moved" / f"{first}_to_{then}"
        p.jobs.append(Job(f"moved_{first}_to_{then}", [
            p.wrapped(*moved, f"train.device={first}", run_dir=folder, options=("--kill-after-checkpoint", "10")),
            p.wrapped(*moved, f"train.device={then}", run_dir=folder)], gpu=dev_gpu))
    p.jobs.append(Job("probe", [[py, str(Path(__file__).resolve()), "probe", "--device", device,
                                 "--json", str(work / "probe.json")]], gpu=dev_gpu))
    tests = [t for t in CUDA_TESTS if (REPO / t).exists()]
    p.jobs.append(Job("cuda_tests", [[py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests, "-k", "cuda"]],
                      gpu=dev_gpu, timeout=280))
    p.jobs = in_order(p.jobs)
    return p


#: Jobs that take longest (a compilation, pytest, two runs in a row, torchrun's start), started first.
LONG = ("amp_compile", "cuda_tests", "resume_killed", "probe", "torchrun_")


def in_order(jobs: list[Job]) -> list[Job]:
    """The long jobs first, and GPU and CPU jobs alternating, so that jobs waiting for a GPU slot hold few of the
    worker threads while CPU jobs could run."""
    def rank(job: Job) -> int:
        first = [i for i, prefix in enumerate(LONG) if job.name.startswith(prefix)]
        return first[0] if first else len(LONG) - 1 if "torch.distributed.run" in job.argvs[0] else len(LONG)

    jobs = sorted(jobs, key=rank)
    gpu, cpu = [j for j in jobs if j.gpu], [j for j in jobs if not j.gpu]
    merged = [j for pair in zip(gpu, cpu) for j in pair]
    return merged + gpu[len(cpu):] + cpu[len(gpu):]


# --------------------------------------------------------------------------------------------------
# Reading runs


def summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    out = json.loads(path.read_text())
    lines = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out["final_train_loss"] = json.loads(lines[-1])["train_loss"] if lines else float("nan")
    return out


def sweep_summaries(root: Path) -> dict[int, dict[str, Any]]:
    """seed -> summary of every finished run of a sweep folder."""
    import yaml

    out = {}
    for path in sorted(root.glob("*/summary.json")):
        seed = yaml.safe_load((path.parent / "config.yaml").read_text())["seed"]
        out[int(seed)] = summary(path.parent)
    return out


def bits_of(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in s.items() if "bits" in k}


def data_dependent(name: str) -> bool:
    """Whether a method's payload depends on the data: its formula uses k (entries sent) or U (their union)."""
    from distlion.methods import METHODS

    info = METHODS[name]
    names = {n.id for f in (info.bits_up, info.bits_down) for n in ast.walk(ast.parse(f)) if isinstance(n, ast.Name)}
    return bool(names & {"k", "U"})


def failure_tail(job: Job | None, lines: int = 3) -> str:
    if job is None:
        return "no job"
    if job.skipped:
        return job.skipped
    interesting = [line for line in job.text().splitlines() if line.strip() and not line.startswith("$ ")]
    return " / ".join(interesting[-lines:])[-400:] or f"exit {job.returncodes}"


# --------------------------------------------------------------------------------------------------
# Checks: (name, PASS | FAIL | not run | info, detail); only FAIL fails the script


Check = tuple[str, str, str]


def method_checks(p: Plan, jobs: dict[str, Job], probe: dict[str, Any]) -> tuple[list[Check], list[str]]:
    from distlion.methods import METHODS

    checks, rows = [], []
    for name in sorted((j.removeprefix("device_") for j in jobs if j.startswith("device_")),
                       key=lambda n: METHODS[n].order):
        ran = summary(p.work / "device" / name)
        seeds = sweep_summaries(p.work / "cpu" / name)
        backend = "simulated" if "simulated" in METHODS[name].cls.backends else "torchrun (1 rank)"
        if ran is None:
            state = "not run" if jobs[f"device_{name}"].skipped else "FAIL"
            checks.append((f"{name} on {p.device}", state, failure_tail(jobs[f"device_{name}"])))
            rows.append(f"| `{name}` | {backend} | {state} | | | | |")
            continue
        problems = []
        losses = [s["final_train_loss"] for s in seeds.values()]
        if len(losses) < 2:
            problems.append(f"only {len(losses)} CPU seed(s) finished ({failure_tail(jobs[f'cpu_{name}'])})")
            band = (math.nan, math.nan)
        else:
            spread = statistics.stdev(losses)
            band = (min(losses) - spread, max(losses) + spread)
            if not band[0] <= ran["final_train_loss"] <= band[1]:
                problems.append(f"final loss {ran['final_train_loss']:.4f} outside [{band[0]:.4f}, {band[1]:.4f}]")
        if data_dependent(name):
            formula = probe.get("formulas", {}).get(name, "no probe result" if "simulated" in backend else "")
            how = "formula (data-dependent)"
            if formula:
                problems.append(f"formula: {formula}")
        else:
            how = "= CPU seed 0"
            reference = seeds.get(0)
            if reference is None:
                problems.append("no CPU run of seed 0 to compare the bits with")
            elif bits_of(ran) != bits_of(reference):
                differ = sorted(k for k in bits_of(ran) if ran[k] != reference.get(k))
                problems.append(f"bits differ from the CPU run's: {', '.join(differ)}")
        state = "FAIL" if problems else "PASS"
        checks.append((f"{name} on {p.device}", state, "; ".join(problems) or
                       f"loss {ran['final_train_loss']:.4f} in band, bits {how}"))
        up, down = ran.get("bits_up_per_param_per_iter", math.nan), ran.get("bits_down_per_param_per_iter", math.nan)
        rows.append(f"| `{name}` | {backend} | {state} | {ran['final_train_loss']:.4f} | "
                    f"{', '.join(f'{x:.4f}' for x in losses)} ([{band[0]:.4f}, {band[1]:.4f}]) | "
                    f"{up:.4g} / {down:.4g} | {how} |")
    return checks, rows


def deterministic_checks(p: Plan, jobs: dict[str, Job]) -> list[Check]:
    out = []
    backend = "NCCL" if p.device == "cuda" else "gloo"
    for name in DETERMINISTIC:
        title = f"{name}: torchrun ({p.ranks} rank(s), {backend}) == simulated, bitwise"
        a, b = summary(p.work / "torchrun" / name), summary(p.work / "simulated" / name)
        if a is None or b is None:
            missing = jobs[f"torchrun_{name}"] if a is None else jobs[f"simulated_{name}"]
            out.append((title, "not run" if missing.skipped else "FAIL", failure_tail(missing)))
            continue
        same = a["params_sha256"] == b["params_sha256"] and bits_of(a) == bits_of(b)
        warned = sorted({line.split("UserWarning: ")[-1][:120] for j in (f"torchrun_{name}", f"simulated_{name}")
                         for line in jobs[j].text().splitlines() if "deterministic" in line and "Warning" in line})
        detail = f"params sha256 {a['params_sha256'][:12]} vs {b['params_sha256'][:12]}"
        if warned:
            detail += f"; ops without a deterministic implementation: {' | '.join(warned)}"
        out.append((title, "PASS" if same else "FAIL", detail))
    return out


def amp_compile_check(p: Plan, jobs: dict[str, Job]) -> Check:
    title = "train.amp=bf16 train.compile=true (dlion, grad_strategy=sequential)"
    ran = summary(p.work / "amp_compile")
    if ran is None:
        job = jobs["amp_compile"]
        return title, "not run" if job.skipped else "FAIL", failure_tail(job)
    seeds = [s["final_train_loss"] for s in sweep_summaries(p.work / "cpu" / "dlion").values()]
    loss = ran["final_train_loss"]
    detail = f"final loss {loss:.4f}, {jobs['amp_compile'].seconds:.0f} s with the compilation"
    if len(seeds) >= 2:
        low, high = min(seeds) - statistics.stdev(seeds), max(seeds) + statistics.stdev(seeds)
        detail += f"; the fp32 CPU seeds' band [{low:.4f}, {high:.4f}]"
        return title, "PASS" if low <= loss <= high else "FAIL", detail
    return title, "PASS" if math.isfinite(loss) else "FAIL", detail


def resume_check(p: Plan, jobs: dict[str, Job]) -> Check:
    title = "a run killed (SIGKILL after its step-10 checkpoint) resumes bitwise"
    job = jobs["resume_killed"]
    reference, resumed = summary(p.work / "resume" / "reference"), summary(p.work / "resume" / "killed")
    if reference is None or resumed is None or len(job.returncodes) < 2:
        missing = jobs["resume_reference"] if reference is None else job
        return title, "not run" if missing.skipped else "FAIL", failure_tail(missing)
    problems = []
    if job.returncodes[0] != -signal.SIGKILL:
        problems.append(f"the first run ended with {job.returncodes[0]}, not killed")
    if "resuming" not in job.text():
        problems.append("the second run did not say it resumed")
    if resumed["params_sha256"] != reference["params_sha256"] or bits_of(resumed) != bits_of(reference):
        problems.append(f"params sha256 {resumed['params_sha256'][:12]} vs {reference['params_sha256'][:12]}")
    return title, "FAIL" if problems else "PASS", "; ".join(problems) or "params and bits equal the uninterrupted run's"


def moved_checks(p: Plan, jobs: dict[str, Job]) -> list[Check]:
    """A run killed after its step-10 checkpoint on one device finishes on the other, saying it resumed there."""
    out = []
    for name in sorted(n for n in jobs if n.startswith("moved_")):
        job, first, then = jobs[name], *name.removeprefix("moved_").split("_to_")
        title = f"a run checkpointed on {first} resumes on {then}"
        resumed = summary(p.work / "moved" / f"{first}_to_{then}")
        if resumed is None or len(job.returncodes) < 2:
            out.append((title, "not run" if job.skipped else "FAIL", failure_tail(job)))
            continue
        problems = []
        if job.returncodes[0] != -signal.SIGKILL:
            problems.append(f"the first run ended with {job.returncodes[0]}, not killed")
        if f"from step 10 on {then}" not in job.text():
            problems.append(f"the second run did not say it resumed from step 10 on {then}")
        if first != then and "another device" not in resumed.get("resume_inexact", ""):
            problems.append("its summary does not say the resume crossed devices (resume_inexact)")
        if not math.isfinite(resumed.get("train_loss", resumed.get("val_loss", math.nan))):
            problems.append("its loss is not finite")
        out.append((title, "FAIL" if problems else "PASS", "; ".join(problems) or
                    f"finished on {resumed.get('device')}, val loss {resumed.get('val_loss', math.nan):.4f}"))
    return out


def probe_checks(p: Plan, jobs: dict[str, Job], probe: dict[str, Any]) -> list[Check]:
    if not probe:
        job = jobs["probe"]
        return [("probe: formulas and kernels", "not run" if job.skipped else "FAIL", failure_tail(job))]
    bad = {k: v for k, v in probe["formulas"].items() if v}
    out = [(f"registry bit formulas of messages built on {p.device} ({len(probe['formulas'])} methods)",
            "FAIL" if bad else "PASS", "; ".join(f"{k}: {v}" for k, v in bad.items()) or "all hold")]
    # On CUDA the Triton kernels must pass their check at load; the C kernels of the CPU are only reported (a
    # machine without a C compiler runs the eager ops, correctly).
    name = "dlion_cuda" if p.device == "cuda" else "dlion"
    status = probe["kernels"][name]
    state = "PASS" if status == "on" else ("FAIL" if p.device == "cuda" else "info")
    out.append((f"fused D-Lion kernels `{name}` ({'Triton' if p.device == 'cuda' else 'C'}) on {p.device}", state,
                status))
    return out


def bench_check(p: Plan, jobs: dict[str, Job], rows: list[dict]) -> Check:
    measured = [r for r in rows if math.isfinite(r.get("value", math.nan))]
    title = "GPU bench rows measured (benchmarks/bench_gpu.py)"
    if "bench" not in jobs:
        return title, "not run", "--no-bench"
    if p.device == "cpu":
        return title, "info", rows[0]["detail"] if rows else "no rows"
    missed = [r["name"] for r in measured if target_mark(r).endswith("(**missed**)")]
    if len(measured) < len(rows) or not rows:
        return title, "FAIL", failure_tail(jobs["bench"])
    return title, "PASS", f"{len(rows)} rows; targets missed: {'; '.join(missed)}" if missed else f"{len(rows)} rows"


def tests_check(jobs: dict[str, Job]) -> Check:
    job = jobs["cuda_tests"]
    lines = [line for line in job.text().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if job.skipped:
        return "CUDA unit tests (pytest -k cuda)", "not run", job.skipped
    ok = job.returncodes and job.returncodes[-1] in (0, 5)  # 5: nothing selected
    skipped = [line for line in lines if line.startswith("SKIPPED")]
    detail = last + (f" ({skipped[0]})" if skipped else "")
    return "CUDA unit tests (pytest -k cuda)", "PASS" if ok else "FAIL", detail


# --------------------------------------------------------------------------------------------------
# Entry points run by the jobs


def train_entry(argv: list[str]) -> None:
    """`python -m distlion.train OVERRIDES`, optionally with deterministic algorithms, or killed by SIGKILL right after
    it wrote its checkpoint at step K (as `kill -9` would, at a known step)."""
    parser = argparse.ArgumentParser(prog="gpu_check.py train")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--kill-after-checkpoint", type=int, default=0)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    import torch

    if args.deterministic:
        # warn_only: an op without a deterministic implementation (integer bincount, exact anyway) says so in the
        # log instead of stopping the run; the bitwise comparison is the check.
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.kill_after_checkpoint:
        from distlion.runio import RunDir

        save = RunDir.save_checkpoint

        def save_then_die(directory: RunDir, suffix: str, state: dict[str, Any]) -> None:
            save(directory, suffix, state)
            if state["step"] == args.kill_after_checkpoint:
                os.kill(os.getpid(), signal.SIGKILL)

        RunDir.save_checkpoint = save_then_die
    from distlion.train import main

    sys.argv = ["distlion.train", *argv[split + 1:]]
    main()


def probe_entry(device_name: str, out: Path) -> None:
    """Bits of messages built on the device against every simulated method's registry formula (a few steps of
    random gradients on the digits ViT's parameter shapes), and the fused kernels' check at load on the device."""
    import torch

    from distlion import kernels
    from distlion.methods import METHODS, runnable_by
    from distlion.methods.dlion import checked_cuda_kernels, checked_kernels

    device = torch.device(device_name)
    shapes = [tuple(p.shape) for p in digits_model().parameters()]
    formulas = {name: formula_problem(name, shapes, device) for name in runnable_by("simulated")}
    betas = (0.9, 0.99)
    if device.type == "cuda":
        checked_cuda_kernels(betas, torch.device("cuda", torch.cuda.current_device()))
    checked_kernels(betas)
    status = {"dlion": kernels.status("dlion"), "dlion_cuda": kernels.status("dlion_cuda")}
    out.write_text(json.dumps({"formulas": formulas, "kernels": status, "methods": sorted(METHODS)}))


def digits_model():
    import hydra
    from omegaconf import OmegaConf

    return hydra.utils.instantiate(OmegaConf.load(REPO / "conf" / "model" / "vit_digits.yaml"))


def formula_problem(name: str, shapes: list[tuple[int, ...]], device, steps: int = 3) -> str:
    """'' when every step's bits of `name` with N=4 workers satisfy its formula with the symbols read off the messages
    (as tests/test_bits.py does on the CPU), else what differed."""
    import torch

    from distlion import Simulation
    from distlion.methods import METHODS

    info = METHODS[name]
    gen = torch.Generator(device="cpu").manual_seed(0)
    hparams = {"sync_every": 1} if info.family == "local" else {}
    try:
        sim = Simulation(name, [torch.randn(s, generator=gen, device="cpu").to(device) for s in shapes], WORKERS,
                         lr=1e-3, **hparams)
    except TypeError as error:
        return f"cannot build: {error}"
    exchanges: list[tuple[list, Any]] = []
    exchange = sim.cluster.backend.exchange

    def recording(how, rule, messages):
        reply, bits = exchange(how, rule, messages)
        exchanges.append((messages, reply))
        return reply, bits

    sim.cluster.backend.exchange = recording
    method = sim.cluster.methods[torch.float32]
    n = sum(math.prod(s) for s in shapes)
    for step in range(steps):
        exchanges.clear()
        grads = [[torch.randn(s, generator=gen, device="cpu").to(device) for s in shapes] for _ in range(WORKERS)]
        out = sim.step(grads, epoch=step * 10.0)  # past DGC's warm-up from the second step on
        up = exchanges[-1][0]
        sent = [set(m["indices"].tolist()) if "indices" in m.tensors else set() for m in up]
        if name == "demo":  # indices within a chunk: the coefficient's place is chunk x s + index
            chunk_of = torch.arange(method.num_chunks, device=device).repeat_interleave(method.topk)
            sent = [set((chunk_of * method.chunk + m["indices"].long()).tolist()) for m in up]
        symbols = {"n": n, "N": WORKERS, "L": len(shapes), "U": len(set().union(*sent)), "z": 0, "H": 1,
                   "n_dense": up[0]["dense"].numel() if "dense" in up[0].tensors else 0,
                   "n_coef": getattr(method, "num_chunks", 0) * getattr(method, "chunk", 0)}
        padding_up = [7 * sum(planes(m[i]) for m, _ in exchanges) for i in range(WORKERS)]
        padding_down = 7 * sum(planes(reply) for _, reply in exchanges)
        for i, bits in enumerate(out.bits_up):
            expected = info.bits(**symbols, k=len(sent[i]))[0] * n
            if not within(bits - expected, padding_up[i]):
                return f"step {step}, worker {i}: {bits} bits up, the formula says {expected:.1f}"
        expected = info.bits(**symbols, k=0)[1] * n
        if not within(out.bits_down - expected, padding_down):
            return f"step {step}: {out.bits_down} bits down, the formula says {expected:.1f}"
    return ""


def within(excess: float, padding: int) -> bool:
    """The bits counted exceed the formula's by no more than the planes' padding (a formula of n-fractions, such as
    64 k / n times n, comes back from floats a hair off its integer)."""
    return -1e-6 <= excess <= padding + 1e-6


def planes(message) -> int:
    import torch

    return sum(math.prod(t.shape[:-1]) for t in message.tensors.values() if t.dtype == torch.uint8)


def bench_entry(out: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out.write_text(json.dumps(module.run()))


# --------------------------------------------------------------------------------------------------
# The report


def environment(py: str, env: dict[str, str]) -> dict[str, Any]:
    code = ("import json, sys, torch, platform\n"
            "out = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
            "       'gpus': torch.cuda.device_count(),\n"
            "       'name': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}\n"
            "import hydra, os\n"
            "out['hydra_from'] = os.path.dirname(os.path.dirname(hydra.__file__))\n"
            "for m in ('hydra', 'omegaconf', 'triton', 'timm', 'torchvision', 'sklearn', 'wandb', 'datasets'):\n"
            "    try:\n"
            "        out[m] = getattr(__import__(m), '__version__', 'present')\n"
            "    except Exception as e:\n"
            "        out[m] = 'absent'\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([py, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise SystemExit(f"gpu_check: {py} cannot import torch or distlion's needs: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def report(p: Plan, info: dict[str, Any], checks: list[Check], method_rows: list[str], bench: list[dict],
           jobs: dict[str, Job], seconds: float) -> str:
    counts = {s: sum(c[1] == s for c in checks) for s in ("PASS", "FAIL", "not run")}
    slowest = sorted((j for j in jobs.values() if j.seconds), key=lambda j: -j.seconds)[:6]
    dry = p.device == "cpu"
    lines = [
        "# GPU check" + (" (dry run on the CPU)" if dry else ""), "",
        f"`scripts/gpu_check.sh{' --device cpu' if dry else ''}` on **{info['name']}** ({info['gpus']} CUDA "
        "device(s)), "
        f"{platform.machine()} with {os.cpu_count()} CPU cores; Python {info['python']}, torch {info['torch']} "
        f"(CUDA {info['cuda']}), Triton {info['triton']}, timm {info['timm']}, torchvision {info['torchvision']}, "
        f"hydra-core {info['hydra']} (from {info['hydra_from']}); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {seconds:.0f} s in all.", "",
        f"**{counts['PASS']} passed, {counts['FAIL']} failed, {counts['not run']} not run.** Runs: digits, {STEPS} "
        "steps, "
        f"`logger=none`; methods simulated with N={WORKERS} on `{p.device}` (the DDP methods as a 1-rank torchrun), "
        f"their CPU references on this machine's CPU, seeds {', '.join(map(str, SEEDS))}.", "",
        "| check | result | detail |", "|---|---|---|",
        *(f"| {name} | {state} | {detail.replace('|', '/')} |" for name, state, detail in checks), "",
        f"## Methods on `{p.device}`", "",
        "Final train loss (the mean over the workers at the last step) against the CPU seeds' band [min - std, "
        "max + std]; bits per parameter per iteration, up / down, checked against the CPU run's (fixed-size payloads) "
        "or the registry formula on messages built on the device (data-dependent ones).", "",
        "| method | backend | result | final loss | CPU seeds (band) | bits up / down | bits checked |",
        "|---|---|---|---:|---|---|---|", *method_rows, "",
        "## Bench rows (benchmarks/bench_gpu.py, measured first, alone on the machine)", "",
        "| benchmark | value | unit | target | detail |", "|---|---:|---|---|---|",
        *(f"| {r['name']} | {r['value']:.3g} | {r['unit']} | {r['target']}{target_mark(r)} | {r['detail']} |"
          for r in bench), "",
        f"Slowest jobs: {', '.join(f'{j.name} {j.seconds:.0f} s' for j in slowest)}. Rerun: `scripts/gpu_check.sh` "
        f"(see its header: wheels from `.whl/`; logs and runs under `{p.work}`).", ""]
    return "\n".join(lines)


def target_mark(row: dict) -> str:
    target, value = str(row.get("target") or ""), row.get("value", math.nan)
    if not target.startswith("<=") or not math.isfinite(value):
        return ""
    return " (met)" if value <= float(target[2:]) else " (**missed**)"


def bench_rows(p: Plan, jobs: dict[str, Job]) -> list[dict]:
    path = p.work / "bench.json"
    if path.exists():
        return json.loads(path.read_text())
    job = jobs.get("bench")
    return [{"name": "gpu bench", "value": math.nan, "unit": "", "target": "", "detail": failure_tail(job)}]


# --------------------------------------------------------------------------------------------------


def guard_dir(work: Path) -> Path:
    """A sitecustomize that makes ABSENT_THERE unimportable (the dry run's stand-in for the GPU machine)."""
    guard = work / "absent"
    guard.mkdir(parents=True, exist_ok=True)
    (guard / "sitecustomize.py").write_text(
        "import sys\n"
        f"ABSENT = {ABSENT_THERE!r}\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ABSENT:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (gpu_check: absent on the GPU machine)',"
        " name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Absent())\n")
    return guard


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("train", "probe", "bench"):
        entry, rest = sys.argv[1], sys.argv[2:]
        if entry == "train":
            return train_entry(rest)
        sub = argparse.ArgumentParser(prog=f"gpu_check.py {entry}")
        sub.add_argument("--device", default="cuda")
        sub.add_argument("--json", type=Path, required=True)
        args = sub.parse_args(rest)
        return probe_entry(args.device, args.json) if entry == "probe" else bench_entry(args.json)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="README.md's folder (default results/gpu; the dry "
                                                               "run: the work folder)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "distlion-gpu-check")
    parser.add_argument("--budget", type=float, default=None, help="seconds (default 270 on CUDA, 3600 dry)")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--gpu-jobs", type=int, default=8)
    parser.add_argument("--methods", default="", help="a comma-separated subset (default: every registered one)")
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()
    start = time.time()
    budget = args.budget or (270.0 if args.device == "cuda" else 3600.0)
    shutil.rmtree(args.work, ignore_errors=True)  # never skip a run as finished by an earlier check
    args.work.mkdir(parents=True)
    (args.work / "logs").mkdir()
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HYDRA_FULL_ERROR": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}
    if args.device == "cpu":
        env["PYTHONPATH"] = os.pathsep.join([str(guard_dir(args.work)), env["PYTHONPATH"]])
        env["CUDA_VISIBLE_DEVICES"] = ""
    info = environment(py, env)
    if args.device == "cuda" and not info["gpus"]:
        raise SystemExit("gpu_check: no CUDA device here; `scripts/gpu_check.sh --device cpu` is the dry run")
    ranks = min(2, info["gpus"]) if args.device == "cuda" else 2
    from distlion.methods import METHODS

    methods = [m for m in args.methods.split(",") if m] or sorted(METHODS, key=lambda m: METHODS[m].order)
    p = plan(py, args.device, args.work, methods, ranks)
    runner = Runner(args.work / "logs", args.jobs, args.gpu_jobs, start + budget, env)
    jobs = {job.name: job for job in p.jobs}
    if not args.no_bench:  # first, alone: timings of a quiet machine
        bench = Job("bench", [[py, str(Path(__file__).resolve()), "bench", "--json", str(args.work / "bench.json")]],
                    gpu=True, timeout=150)
        Runner(args.work / "logs", 1, 1, start + budget, env).run([bench])
        jobs["bench"] = bench
    runner.run(p.jobs)
    probe_path = args.work / "probe.json"
    probe = json.loads(probe_path.read_text()) if probe_path.exists() else {}
    checks, rows = method_checks(p, jobs, probe)
    bench = bench_rows(p, jobs)
    checks = [*probe_checks(p, jobs, probe), *checks, *deterministic_checks(p, jobs), amp_compile_check(p, jobs),
              resume_check(p, jobs), *moved_checks(p, jobs), tests_check(jobs), bench_check(p, jobs, bench)]
    text = report(p, info, checks, rows, bench, jobs, time.time() - start)
    out = args.out or (REPO / "results" / "gpu" if args.device == "cuda" else args.work)
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(text)
    print(text)
    print(f"gpu_check: wrote {out / 'README.md'}; logs in {args.work / 'logs'}")
    sys.exit(1 if any(state == "FAIL" for _, state, _ in checks) else 0)


if __name__ == "__main__":
    main()
