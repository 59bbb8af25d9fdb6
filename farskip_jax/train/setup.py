"""The run's mesh and its models' parameters, placed on the mesh from the first byte.

Student = `program.student_cfg` (FarSkip connectivity, fp32 master weights, `model.dtype`
compute) run as `program.student_exe`; teacher = the same weights with regular connectivity in
`train.teacher_dtype`, frozen, dropless (`program.teacher_config`, `program.teacher_execution`).
Loading, casting and sharding live in one place each: `checkpoint.hf_load.load_params` reads a
checkpoint straight into the student's shardings, `cast_params` derives the teacher on device,
`program.TrainProgram` owns every layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from farskip_jax.config import Config
from farskip_jax.errors import UserError
from farskip_jax.model.layers import DTYPES
from farskip_jax.model.transformer import build_model
from farskip_jax.parallel import param_specs_tree, tile_per_node
from farskip_jax.parallel.mesh import make_mesh
from farskip_jax.train.program import TrainProgram, teacher_copies


@dataclasses.dataclass
class Models:
    student_graph: nnx.GraphDef
    student_params: nnx.State
    teacher_graph: nnx.GraphDef | None
    teacher_params: nnx.State | None


def training_mesh(cfg: Config) -> Mesh:
    """The (data, expert, tensor) mesh of `cfg.mesh` over the local devices; a UserError naming the
    fix when the config asks for a layout this machine cannot run."""
    m = cfg.mesh
    have = jax.device_count()
    if m.num_devices > have:
        raise UserError(
            f"mesh data={m.data} x expert={m.expert} x tensor={m.tensor} needs {m.num_devices} devices, "
            f"{have} available ({jax.default_backend()}); run on {m.num_devices} GPUs or shrink the mesh, "
            f"e.g. --set mesh.expert={max(1, have // m.data)} --set mesh.data=1")
    if cfg.model.n_routed_experts % m.expert:
        raise UserError(f"mesh.expert={m.expert} does not divide model.n_routed_experts="
                        f"{cfg.model.n_routed_experts}; pick a divisor, e.g. --set mesh.expert=1")
    return make_mesh(m)


def state_from_pure(abstract: nnx.State, pure: dict) -> nnx.State:
    """An nnx.State shaped like `abstract` (left untouched) holding the arrays of the pure dict."""
    state = jax.tree.map(lambda x: x, abstract)  # a fresh State: replace_by_pure_dict mutates
    nnx.replace_by_pure_dict(state, pure)
    return state


def init_student_params(cfg: Config, program: TrainProgram) -> nnx.State:
    """The student's parameters in their training layout: from `train.init_checkpoint` (HF dir,
    converted Orbax dir or trainer checkpoint), or random from `train.seed` when it is null. Either
    way each device creates or reads only its own slices."""
    from farskip_jax.checkpoint.common import nest_get
    from farskip_jax.checkpoint.hf_load import load_params

    shardings = program.shardings.params
    path = cfg.train.init_checkpoint
    if path is None:
        mcfg, exe, seed = program.student_cfg, program.student_exe, cfg.train.seed
        # Initialised under jit with output shardings: XLA creates each shard on its device.
        return jax.jit(lambda: nnx.state(build_model(mcfg, seed, exe), nnx.Param), out_shardings=shardings)()
    pure_shardings = nnx.to_pure_dict(shardings)
    pure = load_params(path, program.student_cfg, lambda p: nest_get(pure_shardings, p),
                       DTYPES[program.student_cfg.param_dtype])
    return state_from_pure(program.student_abstract, pure)


def cast_params(params: nnx.State, dtype: Any, shardings: Any, copies: int = 1) -> nnx.State:
    """`params` cast to `dtype` on device, into `shardings`, always as new buffers: the train step
    donates the student's buffers, which must never also be the teacher's (a same-dtype astype
    would otherwise hand back the input itself). `copies` > 1: the routed experts tiled that many
    times (`parallel.tile_per_node`: the teacher's experts inside each node)."""
    cast = lambda x: jnp.array(x.astype(dtype), copy=True)
    return jax.jit(lambda p: tile_per_node(jax.tree.map(cast, p), copies), out_shardings=shardings)(params)


def retile_teacher(params: nnx.State, copies: int, new_copies: int, shardings: Any) -> nnx.State:
    """The teacher's `params`, whose routed experts hold `copies` copies (`tile_per_node`), with
    `new_copies` instead, into `shardings`."""

    def first(x: jax.Array, spec: P) -> jax.Array:
        return x[: x.shape[0] // copies] if "expert" in spec else x

    def retile(p: nnx.State) -> nnx.State:
        one = jax.tree.map(first, p, param_specs_tree(p, "ep"), is_leaf=lambda s: isinstance(s, P))
        return tile_per_node(one, new_copies)

    return jax.jit(retile, out_shardings=shardings)(params)


def build_models(cfg: Config, program: TrainProgram, need_teacher: bool | None = None) -> Models:
    """Student params (fp32 master weights) and, when needed (default: when the train step reads
    the teacher), the teacher's, both placed in the EP layout of `program.mesh`."""
    student = init_student_params(cfg, program)
    if need_teacher is None:
        need_teacher = program.needs_teacher
    teacher = None
    if need_teacher:
        teacher = cast_params(student, DTYPES[program.teacher_cfg.param_dtype], program.teacher_shardings,
                              teacher_copies(program.parallel))
    return Models(program.student_graph, student, program.teacher_graph if need_teacher else None, teacher)
