"""A conversion's output directory, in both directions (HF -> Orbax: `convert`, Orbax -> HF:
`to_hf`): the checks on the output path, the temporary sibling directory that is renamed into
place only when the conversion succeeds, its plan file and the resume rules of an interrupted
conversion, and the test hook that pauses a conversion mid-write to kill it.

Its own module because both converters share it and it knows nothing of either direction's
tensors: each converter builds its own plan (`convert.conversion_plan`, `to_hf.export_plan`) and
finds what an interrupted run already wrote (`convert.written_paths`,
`safetensors_shards.shards_on_disk`); this module only stores the plan, compares it
(`plan_mismatch`), and decides whether a failed run's temp dir is worth keeping (any committed
Orbax save, or a `SHARDS_DONE` listing). It imports neither converter.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from farskip_jax.checkpoint.hf_io import CheckpointError
from farskip_jax.checkpoint.orbax_io import ParamsWriter

# Test hook: seconds to sleep after the first group (with --to-hf: shard) is written, to SIGKILL a
# conversion mid-write.
TEST_PAUSE_ENV = "FARSKIP_CONVERT_TEST_PAUSE_S"
_TMP_TAG = ".farskip-tmp-"
PLAN_FILE = "convert_plan.json"  # in the temp dir only: what an interrupted conversion was writing
# In an Orbax -> HF temp dir only: the safetensors shards complete on disk (each name appended after
# its fdatasync), so that a resumed export starts at the first shard not listed.
SHARDS_DONE = "shards_done.txt"


def output_errors(output: Path, overwrite: bool, inputs: list[Path]) -> list[str]:
    out = output.resolve()
    for i in inputs:
        i = i.resolve()
        if out == i or i in out.parents or out in i.parents:
            return [f"{output}: the output directory must not contain or be inside the input {i}"]
    if output.exists() and not output.is_dir():
        return [f"{output}: exists and is not a directory"]
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        return [f"{output}: output directory exists and is not empty; pass --overwrite to replace it"]
    return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_output_dir(output: Path, log: Callable[[str], None] = print, plan: dict | None = None,
                      resume: bool = False) -> Iterator[Path]:
    """Yields a temp dir next to `output`, renamed to `output` only when the body succeeds.

    `plan` (what is being converted: `convert.conversion_plan`, `to_hf.export_plan`) is written into
    the temp dir first. With `resume`, the temp dir of an interrupted conversion (its pid is gone)
    with the same plan is taken over instead of a new one; without, such dirs are removed. A body
    that fails after writing keeps its temp dir for a later `resume`.
    """
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}{_TMP_TAG}{os.getpid()}"
    adopted = None
    for stale in sorted(output.parent.glob(f".{output.name}{_TMP_TAG}*"), key=lambda p: p.stat().st_mtime):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if resume and plan is not None:
            problem = plan_mismatch(stale, plan)
            if problem is None:
                if adopted is not None:
                    shutil.rmtree(adopted, ignore_errors=True)
                adopted = stale
                continue
            raise CheckpointError(f"--resume: {stale} holds an interrupted conversion of something else "
                                  f"({problem}); rerun with its settings, or without --resume to start over "
                                  "(that removes it)")
        hint = " (--resume would continue it instead)" if plan is not None else ""
        log(f"removing {stale} left by an interrupted conversion{hint}")
        shutil.rmtree(stale, ignore_errors=True)
    if adopted is not None:
        adopted.rename(tmp)
    else:
        if resume:
            log(f"--resume: no interrupted conversion to {output} found; starting from the beginning")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if plan is not None:
            (tmp / PLAN_FILE).write_text(json.dumps(plan, indent=1) + "\n")
    try:
        yield tmp
    except BaseException:
        if plan is not None and (ParamsWriter.committed_saves(tmp) or (tmp / SHARDS_DONE).is_file()):
            log(f"conversion stopped; what was written is kept in {tmp}: rerun the same command with "
                "--resume to continue it")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / PLAN_FILE).unlink(missing_ok=True)
    (tmp / SHARDS_DONE).unlink(missing_ok=True)
    if output.exists():
        # Rename the old output away first, so the output name always holds a complete checkpoint.
        old = output.parent / f".{output.name}.farskip-old-{os.getpid()}"
        output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(output)


def plan_mismatch(tmp: Path, plan: dict) -> str | None:
    """None if the interrupted conversion in `tmp` was converting exactly `plan`, else what differs."""
    f = tmp / PLAN_FILE
    if not f.is_file():
        return f"no {PLAN_FILE}"
    old = json.loads(f.read_text())
    for key in plan:
        if key == "files" and old.get("files") != plan["files"]:
            changed = sorted(n for n in set(plan["files"]) | set(old.get("files", {}))
                             if plan["files"].get(n) != old.get("files", {}).get(n))
            return f"input files changed since: {', '.join(changed[:3])}"
        if old.get(key) != plan[key]:
            return f"{key} was {old.get(key)!r}, now {plan[key]!r}"
    return None


def pause_for_tests(what: str) -> None:
    """Sleeps TEST_PAUSE_ENV seconds (if set) after the first `what` is on disk."""
    pause = float(os.environ.get(TEST_PAUSE_ENV, "0") or 0)
    if pause > 0:
        print(f"farskip-convert: test pause after the first {what}", flush=True)
        time.sleep(pause)
