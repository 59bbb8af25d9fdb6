"""Driving XLA: flags per target, deviceless compiles, the HLO parser, the cost model, PGLE profiles.

Submodules: ``flags`` (the XLA flag table per target), ``aot`` (compile-only meshes and scheduled
HLO for H200 / MI300X), ``rocm_standins`` (loading the ROCm plugin on hosts without AMD GPUs),
``hlo_parse`` (HLO text to computations and instructions), ``costs`` (the per-instruction cost
model: roofline compute, link-model collectives) and ``pgle`` (synthetic profiles from that model
for XLA's latency-hiding scheduler). Shared by ``train`` (the scheduled train step) and
``inspect`` (the overlap report), so the step that runs and the report use one cost model. Import
submodules explicitly: this package imports nothing heavy so that ``rocm_standins.enable()`` can
run before JAX backends start.
"""
