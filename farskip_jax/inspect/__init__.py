"""HLO schedule inspector: the programs to inspect and the report of their collective overlap.

Submodules: ``steps`` (the train, FCSD, prefill and decode programs, abstractly), ``flops`` (useful
FLOPs from the config), ``hlo`` (collective windows, roles, phases and the two-lane replay, on
``farskip_jax.xla.costs``), ``report`` (JSON / Markdown / Perfetto trace, comparisons), ``plot``,
``deps`` and ``cli`` (argparse glue). Compiling for a target and pricing instructions live in
``farskip_jax.xla``, which the trainer uses too; this package only reports and is imported by
nothing below it. Import submodules explicitly: this package imports nothing heavy.
"""
