"""Prints every recorded `PARITY` measurement at the end of the run (also without -s)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest hook
    try:
        from hf_tiny import PARITY_RESULTS
    except ImportError:
        return
    if not PARITY_RESULTS:
        return
    terminalreporter.section("parity: max |ours - reference| per variant")
    for test, variant, err in PARITY_RESULTS:
        terminalreporter.write_line(f"PARITY test={test} variant={variant} max_abs_err={err:.3e}")
