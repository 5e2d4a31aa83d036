"""Profilers and analysis tools for a GPU box, run from a checkout (`python3 -m engines.profiling.NAME`).

Not part of the installed package (pyproject.toml excludes it): nothing served or any `moss-speech bench` command
imports from here.
"""
