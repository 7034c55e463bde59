"""Jobs of test_fsdp_item_dtypes.py: which dtype a weight's padded all-gather input has in a param group FSDP2 gathers
as bytes (a plain bf16 parameter beside it) and in one it does not (the weight alone), and whether the gathered weight
is still the one-device quantization of the full weight ([Note: 16-bit items], hybridq/distributed/layout.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

import hybridq
from hybridq.distributed import apply_hybrid_fsdp
from hybridq.formats import COLUMNWISE, ROWWISE
from hybridq.nn.grouped import GroupedLinear
from hybridq.torch_private import local_tensor

from _compare import parts_diff  # noqa: E402
from _format_cases import FORMATS  # noqa: E402


def _identity_linear():
    """A Linear gathered in high precision (the identity format), 97 rows: 2 bytes per element of the padded shard."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 97, bias=False)
    recipe = hybridq.CustomRecipe(lambda role: FORMATS["identity"]() if role.tensor_type == "weight" else None,
                                  name="identity weights")
    return lin, recipe


def _block_experts():
    """FP8 128x128-tile experts, 3 on 2 ranks (Shard(0), uneven): data and tile scales need 2 bytes per element."""
    torch.manual_seed(0)
    return GroupedLinear(3, 256, 256, bias=False, recipe="fp8_block"), "fp8_block"


# name -> (factory of (layer, recipe), grouped)
CASES = {
    "identity Linear 97x32": (_identity_linear, False),
    "fp8_block experts 3x256x256 Shard(0)": (_block_experts, True),
}


class _Unit(nn.Module):
    """The layer, beside a plain bf16 parameter (a norm's weight) or alone, as one FSDP2 unit."""

    def __init__(self, layer: nn.Module, plain: bool):
        super().__init__()
        self.layer = layer
        self.norm = nn.Parameter(torch.ones(8)) if plain else None


def _expected_parts(layer, full, grouped: bool):
    if not grouped:
        return [layer.weight_quantizer.quantize_parts(full.to(torch.bfloat16), True, True)]
    return [layer.expert_quantizers[e]["weight"].quantize_parts(full[e].to(torch.bfloat16), True, True)
            for e in range(full.shape[0])]


def job_item_dtypes(rank, world_size, device):
    """Per case and grouping: the dtype of the all-gather input the weight handed FSDP2 (its state's last sent
    signature) and the gathered parts that differ from the one-device quantization."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    out = {}
    for name, (factory, grouped) in CASES.items():
        for plain in (False, True):
            layer, recipe = factory()
            unit = _Unit(layer, plain).to(device)
            full = layer.weight.detach().clone()
            apply_hybrid_fsdp(unit, recipe, on_incompatible="error")
            layer = unit.layer  # (a converted nn.Linear is a new module)
            fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
            sharded = local_tensor(layer.weight)
            unit.unshard()
            gw = layer.weight
            got = list(gw.unbind(0)) if grouped else [gw]
            diffs = []
            for e, (g, (ref_r, ref_c)) in enumerate(zip(got, _expected_parts(layer, full, grouped))):
                diffs += parts_diff(g.part(ROWWISE), ref_r, f"{name} [{e}] rowwise")
                diffs += parts_diff(g.part(COLUMNWISE), ref_c, f"{name} [{e}] columnwise")
            unit.reshard()
            out[f"{name} | {'beside a bf16 parameter' if plain else 'alone'}"] = {
                "dtype": str(sharded._hq.last_sig[1]), "diffs": diffs}
    return out
