"""Launchers for candidate Pylon changes, measured with `compare --candidate-command`.

Each module patches Pylon in its own process and then runs `pylon.cli.main`:
the product code is untouched; docs/performance.md reports what each measured.
"""
