"""The torchao_moe baseline: torchao's MoE training conversion of the job's experts (torchao 0.18,
`torchao.prototype.moe_training`: `quantize_(model, Float8TrainingOpConfig(), filter_fn=...)`, FP8 rowwise grouped
GEMMs through `torch._scaled_grouped_mm`), the dense Linears as in the torchao_float8 baseline.

The bridge. torchao converts an expert weight by wrapping its `[E, out, in]` parameter in a tensor subclass that
takes over the `torch._grouped_mm(x, w.transpose(-2, -1), offs=...)` calls reading it (torchtitan's expert
layout). The job's experts (model.Experts) compute through `hybridq.grouped_mm`, which before a hybridq
conversion multiplies expert by expert (`weight.unbind(0)`: plain tensors, which torchao never sees). So the
converted modules become `GroupedMMExperts`: the same parameters, the same math, computed as three
`torch._grouped_mm` calls on the jagged token layout. torchao's FP8 grouped GEMMs need every expert's token
group to be a multiple of 16 rows (the wgrad GEMM's K dimension), which routing does not give: each group is
padded with zero rows to the next multiple of 16 (zero rows add nothing to the weight gradients and their
outputs are dropped), as torchtitan pads its token groups for torchao.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import TORCHAO_MOE, ConfigError
from model import Experts

GROUP_ALIGN = 16  # torch._scaled_grouped_mm's row-group alignment (FP8: 16 bytes along K of the wgrad GEMM)


def padded_groups(m_splits: list[int], device: torch.device, align: int = GROUP_ALIGN
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For tokens sorted by expert (`m_splits[e]` rows of expert e): the row of each token in the layout whose
    groups are padded to multiples of `align`, the padded groups' end offsets (int32, what torch._grouped_mm
    takes) and the layout's row count: the most any routing of these tokens can need, sum(m_splits) + E * (align -
    1) rounded up to `align` -- the same every step, as torchtitan pads for torchao. (The padded total changes with
    the routing; torchao's Triton scale kernels autotune per row count, so a routing-sized layout re-tuned them at
    every step.) Rows after the last group are outside every group: the grouped GEMMs neither read them into a
    product nor write them."""
    sizes = torch.tensor(m_splits, dtype=torch.int64)
    padded = (sizes + align - 1) // align * align
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(sizes, 0) - sizes)  # padded start - start
    dest = torch.arange(int(sizes.sum())) + torch.repeat_interleave(shift, sizes)
    rows = -(-(int(sizes.sum()) + len(m_splits) * (align - 1)) // align) * align
    return dest.to(device), torch.cumsum(padded, 0).to(torch.int32).to(device), rows


class GroupedMMExperts(Experts):
    """model.Experts computed with `torch._grouped_mm` on padded token groups (see the module docstring): what
    torchao's converted expert weights take over."""

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        if isinstance(m_splits, torch.Tensor):  # (the router's device counts: padded_groups lays out on the host)
            m_splits = m_splits.tolist()
        dest, offs, rows = padded_groups(list(m_splits), x.device)
        xp = x.new_zeros(rows, x.shape[-1]).index_copy(0, dest, x)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # w [E, out, in] -> [E, in, out], column-major
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

        h = F.silu(mm(xp, self.w1)) * mm(xp, self.w3)
        return mm(h, self.w2).index_select(0, dest)


def use_grouped_mm(model: nn.Module) -> list[str]:
    """Make every model.Experts of `model` a GroupedMMExperts (same parameters); return their names."""
    names = []
    for name, m in model.named_modules():
        if type(m) is Experts:
            m.__class__ = GroupedMMExperts
            names.append(name)
    return names


def convert_torchao_moe(model: nn.Module, args, out) -> None:
    """The torchao_moe baseline (before fully_shard): the experts through torchao's MoE training conversion, the
    Linears through convert.convert_torchao (torchao float8, tensorwise); refuses when no expert converts."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor
    from torchao.quantization.quant_api import quantize_

    from convert import convert_torchao

    experts = use_grouped_mm(model)
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, GroupedMMExperts))
    converted = [n for n in experts for w in Experts.hybridq_grouped_weights
                 if isinstance(getattr(model.get_submodule(n), w).data, TrainingWeightWrapperBaseTensor)]
    if not converted:
        raise ConfigError(f"recipe {TORCHAO_MOE}: torchao converted no expert weight (experts: "
                          f"{', '.join(experts) or 'none'}), so this run would not be the baseline it is named after")
    out(f"\n{TORCHAO_MOE}: {len(converted)} of {len(experts) * len(Experts.hybridq_grouped_weights)} expert weights "
        "converted by torchao.prototype.moe_training (quantize_ with Float8TrainingOpConfig: FP8 rowwise grouped "
        "GEMMs, torch._scaled_grouped_mm; experts run as torch._grouped_mm on token groups padded to multiples of "
        f"{GROUP_ALIGN}); the Linears as in torchao_float8:")
    convert_torchao(model, args, out)
