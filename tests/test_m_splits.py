"""m_splits, the per-expert token counts of a grouped GEMM: GroupedLinear and `grouped_mm` on an expert module that
was not converted accept the same integer-like forms (ints, numpy integers and arrays, integer tensors and 0-d
tensors) and refuse the same bad ones (bools, floats, a wrong count of experts, negative counts, a wrong sum) with
an error naming m_splits and the layer, before anything is computed."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import hybridq as hq

E, IN, OUT = 4, 64, 32
SPLITS = [3, 0, 5, 2]


class Experts(nn.Module):
    """An expert module of the conversion protocol (one grouped weight)."""

    hybridq_grouped_weights = ("w",)

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(E, OUT, IN))

    def forward(self, x, m_splits):
        return hq.grouped_mm(self, "w", x, m_splits)


def _unconverted():
    m = Experts()
    return m, (lambda x, s: m(x, s))


def _grouped():
    g = hq.GroupedLinear(E, IN, OUT, recipe=hq.recipe("mxfp8"), name="moe")
    return g, (lambda x, s: g(x, s))


def _converted():
    m = Experts()
    hq.convert_experts(m, hq.recipe("mxfp8"))
    return m, (lambda x, s: m(x, s))


CALLERS = {"grouped_mm unconverted": _unconverted, "GroupedLinear": _grouped, "grouped_mm converted": _converted}
INTEGER_LIKE = {
    "list of ints": lambda: list(SPLITS),
    "tuple of numpy int64": lambda: tuple(np.int64(v) for v in SPLITS),
    "list of numpy uint8": lambda: [np.uint8(v) for v in SPLITS],
    "numpy int32 array": lambda: np.array(SPLITS, dtype=np.int32),
    "int64 tensor": lambda: torch.tensor(SPLITS),
    "int32 tensor": lambda: torch.tensor(SPLITS, dtype=torch.int32),
    "list of 0-d tensors": lambda: [torch.tensor(v) for v in SPLITS],
}
BAD = {  # m_splits -> what the error says
    "bools": ([True, False, True, True], "integer token counts"),
    "numpy bools": (np.array([True, False, True, True]), "numpy array of bool"),
    "bool tensor": (torch.tensor([True, False, True, True]), "1-D integer tensor"),
    "floats": ([3.0, 0.0, 5.0, 2.0], "integer token counts"),
    "numpy floats": (np.array(SPLITS, dtype=np.float32), "numpy array of float32"),
    "float 0-d tensors": ([torch.tensor(float(v)) for v in SPLITS], "integer token counts"),
    "0-d tensor": (torch.tensor(10), "0-D"),
    "too many counts": ([3, 0, 5, 2, 0], r"one count per expert \(4\), got 5"),
    "extra tokens in a fifth count": ([3, 0, 5, 2, 10], r"one count per expert \(4\), got 5"),
    "too few counts": ([5, 5], r"one count per expert \(4\), got 2"),
    "negative": ([3, -1, 6, 2], ">= 0"),
    "wrong sum": ([3, 0, 5, 3], "sum to 11 but the input has 10 tokens"),
}


def _reference(w, x, splits):
    return torch.cat([p @ w[e].t() for e, p in enumerate(x.split(splits))])


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("form", INTEGER_LIKE)
def test_integer_like_m_splits_give_the_list_result(caller, form):
    mod, call = CALLERS[caller]()
    x = torch.randn(sum(SPLITS), IN)
    with torch.no_grad():
        assert torch.equal(call(x, INTEGER_LIKE[form]()), call(x, list(SPLITS))), f"{caller}: {form} differed"
    if caller == "grouped_mm unconverted":  # and the list result is the high-precision grouped product
        assert torch.equal(call(x, list(SPLITS)), _reference(mod.w, x, SPLITS))


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("bad", BAD)
def test_bad_m_splits_are_refused_naming_m_splits_and_the_layer(caller, bad):
    mod, call = CALLERS[caller]()
    splits, match = BAD[bad]
    with pytest.raises(ValueError, match=match) as err:
        call(torch.randn(10, IN), splits)
    msg = str(err.value)
    assert "m_splits" in msg, f"the error does not name m_splits: {msg}"
    assert ("moe" if caller == "GroupedLinear" else "w") in msg, f"the error does not name the layer: {msg}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_m_splits_are_checked_without_reading_them():
    """A CUDA integer tensor is checked for dtype and length without a host copy (the values are the device
    path's to use); a wrong length or dtype is still refused."""
    from hybridq.nn.m_splits import checked_m_splits

    s = torch.tensor(SPLITS, device="cuda")
    assert checked_m_splits(s, E, 999, "moe") is s, "a device m_splits was read (its values were checked)"
    with pytest.raises(ValueError, match=r"one count per expert \(4\), got 3"):
        checked_m_splits(s[:3], E, 10, "moe")
    with pytest.raises(ValueError, match="1-D integer tensor"):
        checked_m_splits(s.float(), E, 10, "moe")


def test_device_counts_are_read_on_the_host_once_per_tensor(monkeypatch):
    """The projections of one MoE layer share the router's counts: the per-expert paths read a counts tensor's values
    once (one host sync per layer, not one per projection), and again after the tensor changed in place."""
    from hybridq.nn.m_splits import host_counts
    counts = torch.tensor(SPLITS)
    reads = []
    real = torch.Tensor.tolist

    def counted(t):
        reads.append(t)
        return real(t)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    first, again = host_counts(counts), host_counts(counts)
    counts[0] += 1
    counts[2] -= 1
    changed = host_counts(counts)
    monkeypatch.undo()
    assert first == again == SPLITS and changed == [4, 0, 4, 2], (first, again, changed)
    assert len(reads) == 2, f"{len(reads)} host reads for one tensor read twice, then changed once"
