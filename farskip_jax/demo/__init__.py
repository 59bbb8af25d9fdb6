"""The embedded demo (`python train.py --config tiny_demo`) and the pieces reproduce.py reuses."""

from farskip_jax.demo.pipeline import run_demo

__all__ = ["run_demo"]
