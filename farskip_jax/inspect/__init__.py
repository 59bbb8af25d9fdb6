"""HLO schedule inspector: deviceless compile for H200/MI300X and collective-overlap analysis.

Submodules: ``aot`` (compile-only meshes and scheduled HLO), ``hlo`` (parser, roofline, overlap),
``report`` (JSON / Markdown / Perfetto trace, comparisons), ``cli`` (argparse glue),
``rocm_standins`` (ROCm plugin loading on CPU-only hosts). Import them explicitly; this package
imports nothing heavy so that ``rocm_standins.enable()`` can still run before JAX backends start.
"""
