"""Prints every recorded `PARALLEL_ERR` measurement at the end of the run (also without -s)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest hook
    try:
        from par_common import RESULTS
    except ImportError:
        return
    if not RESULTS:
        return
    terminalreporter.section("parallel: max |sharded - single device| per case")
    for test, case, quantity, err in RESULTS:
        terminalreporter.write_line(f"PARALLEL_ERR test={test} case={case} {quantity} max_abs_err={err:.3e}")
