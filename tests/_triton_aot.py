"""Triton kernels compiled for sm_90 without a GPU (Triton's ahead-of-time API): CPU tests that a kernel still builds
to what the GPU runs (wgmma, pipelined loads)."""

from __future__ import annotations


def compile_sm90(kernel, sig: dict, constexprs: dict, aligned: tuple, warps: int, stages: int):
    """`kernel` compiled for sm_90 with the signature `sig` (argument name -> Triton type), the `constexprs`, and the
    16-byte alignment a real launch gets for the arguments named in `aligned`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**sig, **{n: "constexpr" for n in constexprs}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
