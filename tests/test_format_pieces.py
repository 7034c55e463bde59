"""Pieces of a tensor cut along K (tensor parallelism: a row-parallel weight or input, a column-parallel
grad_output) or along M (a column-parallel weight): each piece quantized with the MAX-reduced `piece_stats` of its
cut (per-tensor statistics, or per-axis ones such as rowwise FP8's row amaxes) is, bit for bit, the corresponding
piece of quantizing the whole tensor, for every format and hybrid; cuts that split a block are refused by
`check_column_cuts` before anything is quantized."""

from __future__ import annotations

import pytest
import torch

from hybridq.distributed.pieces import check_column_cuts
from hybridq.errors import FormatShapeError

from _compare import assert_bitwise
from _format_cases import FORMATS, hybrid

CASES = {n: f for n, f in FORMATS.items() if n not in ("fp8_e4m3_delayed", "nvfp4_sr")}
CASES["hybrid_mxfp8_nvfp4_rht"] = hybrid("mxfp8_e4m3", "nvfp4_rht")
CASES["hybrid_fp8_identity"] = hybrid("fp8_e4m3", "identity")
CASES["hybrid_fp8blk_mxfp8"] = hybrid("fp8blk_1x128_e4m3", "mxfp8_e4m3")


def _pieces(q, x, cuts, rowwise, columnwise, cut="K"):
    bounds = [0, *cuts, x.shape[1 if cut == "K" else 0]]
    pieces = [(x[:, a:b] if cut == "K" else x[a:b]).contiguous() for a, b in zip(bounds, bounds[1:])]
    stats = [q.piece_stats(p, rowwise, columnwise, cut) for p in pieces]
    reduced = None if stats[0] is None else torch.stack(stats).amax(0)
    return bounds, [q.quantize_piece(p, rowwise, columnwise, reduced, cut) for p in pieces]


def _piece_of(t: torch.Tensor, cut: str, a: int, b: int) -> torch.Tensor:
    """Rows (cut "M") or columns (cut "K") [a, b) of a `[M, K]` tensor."""
    return t[:, a:b] if cut == "K" else t[a:b]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("direction", ["rowwise", "columnwise", "both"])
@pytest.mark.parametrize("cut", ["K", "M"], ids=["column_pieces", "row_pieces"])
def test_a_piece_is_the_piece_of_the_whole_quantization(name, direction, cut):
    q = CASES[name]()
    rowwise, columnwise = direction in ("rowwise", "both"), direction in ("columnwise", "both")
    g_rows, g_cols = q.split_granularity(rowwise, columnwise)
    if cut == "K":  # 3 pieces of K, the global amax in the last one
        m, k = 2 * max(g_rows, 16), 3 * max(g_cols, 16)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 2, k)
        x[0, -1] = 300.0
    else:  # 3 pieces of M
        m, k = 3 * max(g_rows, 16), 2 * max(g_cols, 16)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, m)[:, None]
        x[-1, 0] = 300.0
    n = k if cut == "K" else m
    whole = q.quantize_parts(x, rowwise, columnwise)
    bounds, pieces = _pieces(q, x, [n // 3, 2 * n // 3], rowwise, columnwise, cut)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for d, (got, want) in enumerate(zip(pieces[i], whole)):
            if want is None:
                continue
            stored = want.dequantize_2d()  # [M, K] rowwise, [K, M] columnwise
            want_vals = _piece_of(stored if d == 0 else stored.t(), cut, a, b)
            assert_bitwise(got.dequantize_2d(), want_vals if d == 0 else want_vals.t(),
                           f"{name} {('rowwise', 'columnwise')[d]} values of {'columns' if cut == 'K' else 'rows'} "
                           f"[{a}, {b})")


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "fp8blk_1x128_e4m3", "nvfp4", "hybrid_mxfp8_nvfp4_rht"])
def test_a_cut_inside_a_block_is_refused_naming_the_tensor_and_the_rule(name):
    q = CASES[name]()
    g = q.split_granularity(True, False)[1]
    k = 3 * g  # two ranks: the cut at ceil(k / 2) lies inside a block
    with pytest.raises(FormatShapeError, match=rf"weight of fc2.*{g}"):
        check_column_cuts(q, k, 2, True, False, "weight of fc2")
    check_column_cuts(q, 4 * g, 2, True, False, "weight of fc2")  # a cut on a block boundary is accepted
