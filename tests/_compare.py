"""Bitwise comparison of tensors and quantized parts for the tests (not a test module).

Every helper says what differed: the tensor or field name, how many elements differ, the first index and both
values. `nan_payload=True` treats every NaN of a floating tensor as equal to every other NaN (same positions
required; a tuple of dtypes limits this to tensors of those dtypes): NaN payloads are not part of the numerics contract (docs/numerics.md, "Non-finite values"), and the
CUDA kernels may produce a different payload than the reference.
"""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (any dtype), shape [..., element_size * last dim]."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-sized integers (bit patterns), same shape."""
    t = t.contiguous()
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.dim() else t.reshape(1).view(_INT_OF_SIZE[t.element_size()])


def tensor_diff(got: torch.Tensor, want: torch.Tensor, what: str, *, nan_payload: bool | tuple[torch.dtype, ...] = False) -> str | None:
    """How `got` differs from `want` bit for bit (dtype, shape, elements); None if identical. `got` may be on
    any device (it is moved to `want`'s)."""
    if got.dtype != want.dtype:
        return f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got = got.to(want.device)
    bg, bw = _bits(got), _bits(want)
    if got.is_floating_point() and (nan_payload is True or (nan_payload and got.dtype in nan_payload)):
        gn, wn = torch.isnan(got), torch.isnan(want)
        if not torch.equal(gn, wn):
            bad = (gn != wn).nonzero()
            return (f"{what}: NaN positions differ at {bad.shape[0]} elements; first at {bad[0].tolist()}: "
                    f"got {got[tuple(bad[0])].item()!r}, want {want[tuple(bad[0])].item()!r}")
        # payloads ignored: NaNs compared as zero bits (on the integer view: CUDA has no masked_fill for fp8)
        bg, bw = bg.masked_fill(gn.reshape(bg.shape), 0), bw.masked_fill(wn.reshape(bw.shape), 0)
    bad = (bg != bw).nonzero()
    if bad.numel() == 0:
        return None
    i = tuple(bad[0])
    vg, vw = got.reshape(bg.shape)[i].item(), want.reshape(bw.shape)[i].item()
    return (f"{what}: {bad.shape[0]} of {bg.numel()} elements differ; first at {bad[0].tolist()}: "
            f"got {vg!r} (bits {int(bg[i])}), want {vw!r} (bits {int(bw[i])})")


def close_diff(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float) -> tuple[float, str | None]:
    """(max |got - want| / max |want|, None) when that is within `rtol`, else (it, a message saying how many elements
    are beyond: a few = one moved quantization step, many = a bug). NaN never passes."""
    diff = (got.float() - want.float().to(got.device)).abs()
    scale = want.float().abs().max().item() or 1.0
    err = diff.max().item() / scale
    if err <= rtol:
        return err, None
    return err, (f"{what}: max |diff| {err * scale:.3e} = {err:.3e} x max |want| {scale:.3e} > {rtol:.1e} "
                 f"({int((diff > rtol * scale).sum())} of {diff.numel()} elements beyond)")


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str, *, nan_payload: bool | tuple[torch.dtype, ...] = False) -> None:
    """`got` equals `want` bit for bit (see tensor_diff)."""
    diff = tensor_diff(got, want, what, nan_payload=nan_payload)
    assert diff is None, diff


def parts_diff(got, want, what: str, *, nan_payload: bool | tuple[torch.dtype, ...] = False) -> list[str]:
    """How the quantized part `got` differs from `want`: presence, type, geometry, metadata and every tensor
    field bit for bit; [] if identical."""
    if (got is None) or (want is None):
        return [] if got is want else [f"{what}: one part is None ({got!r} vs {want!r})"]
    if type(got) is not type(want):
        return [f"{what}: part types {type(got).__name__} != {type(want).__name__}"]
    if (got.rows, got.cols, got.columnwise) != (want.rows, want.cols, want.columnwise):
        return [f"{what}: geometry (rows, cols, columnwise) {(got.rows, got.cols, got.columnwise)} != "
                f"{(want.rows, want.cols, want.columnwise)}"]
    if got.meta() != want.meta():
        return [f"{what}: metadata {got.meta()} != {want.meta()}"]
    out = []
    gt = got.tensors()
    for name, w in want.tensors().items():
        g = gt[name]
        if (g is None) or (w is None):
            if g is not w:
                out.append(f"{what}.{name}: one is None")
            continue
        diff = tensor_diff(g, w, f"{what}.{name}", nan_payload=nan_payload)
        if diff is not None:
            out.append(diff)
    return out


def assert_parts_bitwise(got, want, what: str, *, nan_payload: bool | tuple[torch.dtype, ...] = False) -> None:
    """`got` and `want` are the same part bit for bit (see parts_diff)."""
    diff = parts_diff(got, want, what, nan_payload=nan_payload)
    assert not diff, "\n".join(diff)


__all__ = ["raw_bytes", "tensor_diff", "assert_bitwise", "parts_diff", "assert_parts_bitwise"]


def assert_results_bitwise(got: dict, want: dict, what: str) -> None:
    """Two runs' results by name (e.g. output, input and weight gradients) equal bitwise; None only where None."""
    for k, w in want.items():
        if w is None:
            assert got[k] is None, f"{what}: {k} is {got[k]}, expected None"
        else:
            assert_bitwise(got[k], w, f"{what}: {k}")


def step_diffs(step: int, got: tuple, want: tuple, what: str = "loss") -> list[str]:
    """What differs between two models' results of one training step: (loss or output, {name: gradient}) each."""
    (out_g, grads_g), (out_w, grads_w) = got, want
    return [d for d in [tensor_diff(out_g, out_w, f"step {step} {what}")] if d] + \
        [d for n in grads_w for d in [tensor_diff(grads_g[n], grads_w[n], f"step {step} grad {n}")] if d]


def parameter_diffs(got_model, want_model, what: str) -> list[str]:
    """What differs between two models' parameters (DTensors compared whole), each named with `what`."""
    out = []
    for (n, pw), (_, pg) in zip(want_model.named_parameters(), got_model.named_parameters()):
        full = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (pg.detach(), pw.detach())]
        out += [d for d in [tensor_diff(*full, f"{n} {what}")] if d]
    return out



def assert_training_runs_bitwise(got: dict, want: dict, where: str, change: str) -> None:
    """Two training runs' records equal bit for bit, `change` naming what the `got` run switched (for the message):
    the gathered parts read ("gathered" or "parts": one (names..., {part: tensor}) per read, in order), the losses
    and the gradients per step, and the final parameters where both recorded them."""
    key = "gathered" if "gathered" in want else "parts"
    reads_g, reads_w = got[key], want[key]
    assert len(reads_g) == len(reads_w), f"{where}: {len(reads_g)} gathered reads {change}, {len(reads_w)} without"
    for i, (rg, rw) in enumerate(zip(reads_g, reads_w)):
        (*names_g, parts_g), (*names_w, parts_w) = rg, rw
        assert names_g == names_w and parts_g.keys() == parts_w.keys(), \
            f"{where}: gathered read #{i} is {names_g} {list(parts_g)} {change}, {names_w} {list(parts_w)} without"
        for t in parts_w:
            assert torch.equal(parts_g[t], parts_w[t]), (
                f"{where}: gathered {' '.join(map(str, names_w))} {t} (read #{i}) differs {change}: "
                f"{(parts_g[t] != parts_w[t]).sum().item()} bytes")
    for s, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert torch.equal(a, b), f"{where}: loss of step {s} differs {change}"
    for s, (ga, gb) in enumerate(zip(got["grads"], want["grads"])):
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), f"{where}: gradient of parameter {i} at step {s} differs {change}"
    for i, (a, b) in enumerate(zip(got.get("params", []), want.get("params", []))):
        assert torch.equal(a, b), f"{where}: parameter {i} after training differs {change}"
