"""The sections of ``benchmarks/gpu_validation.py``: one module per claim group of the GPU issue.

Each section module exposes ``NAME`` (its short name) and ``run(ctx: Context) -> list[Row]``;
the driver runs each section in a fresh process (``python benchmarks/gpu_validation.py --section
NAME``), so a section that crashes CUDA or hangs costs only its own rows. Every section also runs
with ``--device cpu`` (the CPU-side tests drive the harness that way), where a row that needs CUDA
says ``skip`` with the reason instead of pretending.
"""
