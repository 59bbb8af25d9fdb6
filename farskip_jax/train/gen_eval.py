"""Evaluation by free-running generation, for early stopping on what the model produces.

`train.gen_eval.path` is a JSONL file; every record has a "prompt" and either
* an "answer": the metric is `exact_match`, the share of greedy completions equal to it
  (surrounding whitespace ignored), or
* "tests" (a string, or a list of statements such as MBPP's asserts): the metric is `pass_at_1`,
  the share of greedy completions that pass them. The program is the completion's first fenced
  code block (``` or ```python), else the whole completion, followed by the tests.

Every program runs in its own subprocess (`run_program`): a throwaway working directory, an empty
environment, `python -I`, CPU-time, address-space and file-size limits, a wall-clock timeout that
kills its whole process group, and sockets disabled. A crash, hang or limit hit is a failed
sample; nothing a program does can stop training. (This keeps honest mistakes contained; it is
not a security boundary against hostile code: run untrusted models' code in a container.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from farskip_jax.config import GenEvalConfig, ModelConfig
from farskip_jax.errors import UserError, jsonl_values

# Prepended to every program: its limits, then no network (best effort, see the module
# docstring). Set by the program itself rather than in a preexec_fn, which would fork the
# multithreaded training process and run Python in the child.
_PRELUDE = """\
import resource as _r
for _k, _v in (("RLIMIT_CPU", {cpu}), ("RLIMIT_AS", {mem}), ("RLIMIT_FSIZE", {fsize}), ("RLIMIT_CORE", 0)):
    _r.setrlimit(getattr(_r, _k), (_v, _v))
import socket as _socket
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled during evaluation")
_socket.socket = _socket.create_connection = _socket.getaddrinfo = _no_network
del _r, _k, _v, _socket
"""
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.S)


@dataclasses.dataclass(frozen=True)
class Task:
    prompt: str
    answer: str | None = None
    tests: str | None = None


def load_tasks(path: str | Path, limit: int | None = None) -> tuple[str, list[Task]]:
    """(metric, tasks) from a JSONL file; every problem is named by file and line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"train.gen_eval.path: {p} does not exist")
    tasks: list[Task] = []
    kinds = set()
    for n, rec in jsonl_values(p, str(p)):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise UserError(f"{p}:{n}: expected an object with a string 'prompt'")
        if isinstance(rec.get("answer"), str):
            kinds.add("exact_match")
            tasks.append(Task(rec["prompt"], answer=rec["answer"]))
        elif isinstance(rec.get("tests"), (str, list)):
            tests = rec["tests"] if isinstance(rec["tests"], str) else "\n".join(map(str, rec["tests"]))
            kinds.add("pass_at_1")
            tasks.append(Task(rec["prompt"], tests=tests))
        else:
            raise UserError(f"{p}:{n}: needs an 'answer' string (exact_match) or 'tests' (pass_at_1)")
        if limit is not None and len(tasks) == limit:
            break
    if not tasks:
        raise UserError(f"{p}: no records")
    if len(kinds) > 1:
        raise UserError(f"{p}: mixes 'answer' and 'tests' records; use one kind per file")
    return kinds.pop(), tasks


def extract_program(completion: str) -> str:
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def run_program(source: str, cfg: GenEvalConfig) -> tuple[bool, str]:
    """(passed, why) for one program: exit status 0 within the limits."""
    prelude = _PRELUDE.format(cpu=cfg.cpu_s, mem=cfg.memory_mb * 2**20, fsize=16 * 2**20)
    with tempfile.TemporaryDirectory(prefix="farskip_eval_") as work:
        program = Path(work) / "program.py"
        program.write_text(prelude + source)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-B", str(program)], cwd=work,
                                    env={"PATH": "/usr/bin:/bin", "HOME": work}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            return False, f"could not start: {e}"
        try:
            _, err = proc.communicate(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, f"timeout after {cfg.timeout_s:g} s"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode == 0:
        return True, "passed"
    last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
    return False, f"exit status {proc.returncode}: {last[0][:200]}"


def pass_at_1(tasks: list[Task], completions: list[str], cfg: GenEvalConfig) -> float:
    """Share of tasks whose completion passes its tests (programs run `cfg.workers` at a time)."""
    sources = [extract_program(c) + "\n\n" + t.tests + "\n" for t, c in zip(tasks, completions, strict=True)]
    with concurrent.futures.ThreadPoolExecutor(cfg.workers) as pool:
        results = list(pool.map(lambda s: run_program(s, cfg), sources))
    return sum(ok for ok, _ in results) / len(results)


def exact_match(tasks: list[Task], completions: list[str]) -> float:
    return sum(c.strip() == t.answer.strip() for t, c in zip(tasks, completions, strict=True)) / len(tasks)


class GenerationEval:
    """Greedy completions of the tasks' prompts by the student, scored by the file's metric."""

    def __init__(self, cfg: GenEvalConfig, model_cfg: ModelConfig, graph: nnx.GraphDef, params_like: Any,
                 tokenizer_path: str, template: Any):
        from farskip_jax.data.pipeline import load_tokenizer
        from farskip_jax.generation import Generator, tensor_parallel_mesh
        from farskip_jax.model.transformer import Transformer

        self.cfg = cfg
        self.metric, self.tasks = load_tasks(cfg.path, cfg.limit)
        self.tok = load_tokenizer(tokenizer_path)
        eos = self.tok.token_to_id(template.eos)
        self.eos_ids = [] if eos is None else [eos]
        self.prompts = [self._encode(t.prompt, template) for t in self.tasks]
        model = nnx.merge(graph, params_like)
        if not isinstance(model, Transformer):
            raise TypeError(f"expected the student Transformer, got {type(model).__name__}")
        self.generator = Generator(model, tensor_parallel_mesh(model_cfg, jax.devices()))

    def _encode(self, prompt: str, t: Any) -> list[int]:
        ids = [] if not t.bos else [self.tok.token_to_id(t.bos)]
        for text in (t.user_prefix, prompt, t.user_suffix, t.assistant_prefix):
            ids += self.tok.encode(text, add_special_tokens=False).ids if text else []
        return ids

    def __call__(self, params: nnx.State) -> dict[str, float]:
        from farskip_jax.generation import PAD, pad_prompts

        self.generator.load(params)
        completions: list[str] = []
        n = self.cfg.batch_size
        for i in range(0, len(self.prompts), n):
            rows = self.prompts[i : i + n]
            out = self.generator.generate(pad_prompts(rows), self.cfg.max_new_tokens, eos_ids=self.eos_ids)
            for b, r in enumerate(rows):
                new = [int(t) for t in out[b, len(r) :] if t != PAD and int(t) not in self.eos_ids]
                completions.append(self.tok.decode(new, skip_special_tokens=True))
        score = (exact_match(self.tasks, completions) if self.metric == "exact_match"
                 else pass_at_1(self.tasks, completions, self.cfg))
        return {self.metric: score, "gen_samples": float(len(self.tasks))}
