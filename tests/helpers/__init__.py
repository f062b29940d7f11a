"""Shared helpers of the test suite, one module per concept: `from helpers.capture import make_prepared`.

tests/ is on `sys.path` (pytest puts the directory of the root conftest.py there; `helpers.procs` puts it there for the
forkserver's children and the emulated SGLang server gets it through PYTHONPATH), so every test imports them alike.
"""
