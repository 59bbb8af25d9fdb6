"""Builds what a run needs from its Config: student/teacher models, mesh placement, data iterators.

Student = the config's model (FarSkip connectivity, fp32 master weights, `model.dtype` compute);
teacher = the same weights with regular connectivity, cast to `train.teacher_dtype`, frozen.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.config import Config, ModelConfig
from farskip_jax.data import ChatTemplate, DataConfig, build_pipeline
from farskip_jax.model import Transformer, build_model, with_farskip
from farskip_jax.model.layers import DTYPES
from farskip_jax.parallel import BATCH_AXES, ExpertParallel, make_mesh, place

log = logging.getLogger(__name__)
# cfg.data keys the trainer owns; the rest are DataConfig fields.
TRAINER_DATA_KEYS = ("eval_paths",)


@dataclasses.dataclass
class Models:
    student_graph: nnx.GraphDef
    student_params: nnx.State
    teacher_graph: nnx.GraphDef | None
    teacher_params: nnx.State | None


def _load_initial_state(cfg: Config) -> nnx.State:
    """fp32 parameters of the original model: HF dir, Orbax checkpoint, or random from train.seed."""
    base = with_farskip(cfg.model, enabled=False)
    base = dataclasses.replace(base, param_dtype="float32")
    path = cfg.train.init_checkpoint
    if path is None:
        return nnx.state(build_model(base, cfg.train.seed), nnx.Param)
    p = Path(path)
    from farskip_jax.checkpoint.convert import is_orbax_checkpoint

    if (p / "config.json").exists() or is_orbax_checkpoint(p):  # HF dir, or one convert.py wrote
        from farskip_jax import from_pretrained

        model = from_pretrained(p, **{"farskip.enabled": False, "param_dtype": "float32"})
        return nnx.state(model, nnx.Param)
    # A training checkpoint of this trainer: a step directory with "params", or a run's checkpoints dir.
    if not (p / "params").is_dir():
        steps = sorted(int(q.name) for q in p.iterdir() if q.name.isdigit() and (q / "params").is_dir())
        if not steps:
            raise FileNotFoundError(f"init_checkpoint {path}: neither an HF dir (config.json) nor an Orbax "
                                    "checkpoint (a 'params' item or step directories holding one)")
        p = p / str(steps[-1])
    abstract_state = nnx.state(nnx.eval_shape(lambda: build_model(base, 0)), nnx.Param)
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(abstract_state))
    pure = ocp.StandardCheckpointer().restore((p / "params").absolute(), target)
    nnx.replace_by_pure_dict(abstract_state, pure)
    return abstract_state


def _graph(mcfg: ModelConfig) -> nnx.GraphDef:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, nnx.Rngs(0))), nnx.Param)
    return graphdef


def build_models(cfg: Config, mesh: Mesh, need_teacher: bool) -> Models:
    """Student and (optionally) teacher, their params placed with the EP layout on `mesh`."""
    init = _load_initial_state(cfg)
    student_cfg = cfg.model  # param_dtype float32 = fp32 master weights, dtype = compute dtype
    s_graph = _graph(student_cfg)
    cast = lambda dtype: jax.tree.map(lambda x: jnp.asarray(x, DTYPES[dtype]), init)
    s_params = place(cast(student_cfg.param_dtype), mesh, "ep")
    t_graph = t_params = None
    if need_teacher:
        tcfg = dataclasses.replace(with_farskip(cfg.model, enabled=False),
                                   param_dtype=cfg.train.teacher_dtype)
        t_graph = _graph(tcfg)
        # A copy, not a view: with teacher_dtype == param_dtype the cast is a no-op, and the train step
        # donates the student's buffers, which would then also delete the teacher's.
        t_params = place(jax.tree.map(lambda x: jnp.array(x, DTYPES[tcfg.param_dtype], copy=True), init),
                         mesh, "ep")
    return Models(s_graph, s_params, t_graph, t_params)


def mesh_and_parallel(cfg: Config) -> tuple[Mesh, Any]:
    """The training mesh and the model's `parallel=` object (None: plain local routing)."""
    if cfg.mesh.tensor != 1:
        raise ValueError("training uses the EP layout: set mesh.tensor=1 "
                         "(tensor parallelism is for inference)")
    mesh = make_mesh(cfg.mesh)
    return mesh, (ExpertParallel(mesh) if cfg.mesh.expert > 1 else None)


# --------------------------------------------------------------------------------------------
# Data


def data_config(cfg: Config, paths_key: str = "paths") -> DataConfig:
    d = {k: v for k, v in cfg.data.items() if k not in TRAINER_DATA_KEYS}
    if paths_key != "paths":
        d["paths"] = cfg.data[paths_key]
    if "paths" not in d or "tokenizer" not in d:
        raise ValueError("config section data needs 'paths' and 'tokenizer' (set data.paths=[...] "
                         "data.tokenizer=tokenizer.json)")
    if isinstance(d.get("template"), dict):
        d["template"] = ChatTemplate(**d["template"])
    return DataConfig(**d)


class BatchStream:
    """Global [A, B, T] step batches from this process's grain iterator, sharded over (data, expert).

    `data.batch_size` is the per-process micro-batch; A = train.grad_accum_steps micro-batches make a step.
    """

    def __init__(self, cfg: Config, mesh: Mesh, accum: int, paths_key: str = "paths"):
        self.pipeline = build_pipeline(data_config(cfg, paths_key), process_index=jax.process_index(),
                                       process_count=jax.process_count())
        self.iterator = iter(self.pipeline)
        self.accum = accum
        self.sharding = NamedSharding(mesh, P(None, BATCH_AXES))

    def next_host(self) -> dict[str, np.ndarray]:
        mbs = [next(self.iterator) for _ in range(self.accum)]
        return {k: np.stack([np.asarray(m[k]) for m in mbs]) for k in mbs[0]}

    def to_device(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(self.sharding, v) for k, v in host.items()}

    def get_state(self) -> Any:
        return self.iterator.get_state()

    def set_state(self, state: Any) -> None:
        self.iterator.set_state(state)


def eval_batches(cfg: Config, mesh: Mesh) -> list[dict[str, np.ndarray]] | None:
    """The first `train.eval_batches` batches of `data.eval_paths` (the same ones every evaluation)."""
    if not cfg.data.get("eval_paths"):
        return None
    stream = BatchStream(cfg, mesh, 1, "eval_paths")
    return [{k: v[0] for k, v in stream.next_host().items()} for _ in range(cfg.train.eval_batches)]
