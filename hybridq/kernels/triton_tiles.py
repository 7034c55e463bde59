"""Device functions the Triton GEMM kernels share (Triton is optional: nothing is defined without it)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (ImportError, or a broken install)
    triton = tl = None

if triton is not None:
    @triton.jit
    def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of program `pid` among num_m x num_n output tiles in the grouped launch order:
        GROUP_M row tiles in a row share their column operand's tiles in L2."""
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % width) % size_m, (pid % width) // size_m
