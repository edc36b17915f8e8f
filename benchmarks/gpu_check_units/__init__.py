"""The units of ``benchmarks/gpu_check.py``, one module per part of the report (see its docstring)."""
