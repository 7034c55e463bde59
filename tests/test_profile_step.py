"""benchmarks/profile_step.py: the kernel-name categories (real names from H100 traces), the CPU attribution rule, the
interval union, and the CPU smoke run in a subprocess (table structure and JSON keys; times are not checked)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step as ps  # noqa: E402


@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_qrtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT", "gemm"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off", "gemm"),
    ("_ZN7cutlass13device_kernelIN49_GLOBAL__N__6ea3a2a8_22_sm90_gemm_tma_warpspecializedE", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)", "gemm"),
    ("aten::mm", "gemm"),
    ("aten::_scaled_mm", "gemm"),
    ("void hybridq::quantize_tile_kernel<hybridq::Fp8TensorTile, __nv_bfloat16>(...)", "hybridq"),
    ("void hybridq::(anonymous namespace)::absmax_kernel<c10::BFloat16>(...)", "hybridq"),
    ("void hybridq::transpose_u8_kernel<32>(...)", "hybridq"),
    ("void hybridq::(anonymous namespace)::rms_norm_fwd_kernel<8, __nv_bfloat16, float>(...)", "norm"),
    ("void hybridq::(anonymous namespace)::rms_norm_bwd_dw_kernel<__nv_bfloat16>(...)", "norm"),
    ("void hybridq::(anonymous namespace)::norm_fwd_kernel<8, __nv_bfloat16, float, true, 32>(...)", "norm"),
    ("void hybridq::(anonymous namespace)::norm_bwd_dx_kernel<8, __nv_bfloat16, float, false>(...)", "norm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(...)", "norm"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>(...)",
     "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>(...)", "attention"),
    ("_ZN7cutlass13device_kernelIN5flash16enable_sm90_or_laterINS1_16FlashAttnFwdSm90E", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x256_4x1x1_cga1x1", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 256>(void const*, void const*, void*)", "attention"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_nt_align1>(cutlass_80_simt_sgemm_64x64_8x5_nt_align1"
     "::Params)", "gemm"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_execute_kernel",
     "gemm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, 1, 0>>(...)",
     "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<float, 2, 1, 1>, "
     "at::native::Copy<float, float>>(...)", "memcpy"),
    ("aten::_foreach_lerp_", "optimizer"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("c10d::_allgather_base_", "collectives"),
    ("fsdp::all_gather_copy_in", "memcpy"),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul>>(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
     "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<...>>>(...)",
     "elementwise"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(...)", "elementwise"),
    ("aten::add_", "elementwise"),
    ("FSDP::post_backward_reduce (layers.0)", "other"),
    ("some_custom_kernel", "other"),
])
def test_categorize_real_kernel_names(name, category):
    assert ps.categorize(name) == category
    assert category in ps.CATEGORIES


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-gather"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", "all-gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce-scatter"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-reduce"),
    ("c10d::_allgather_base_", "all-gather"),
    ("FSDP::all_gather (layers.0)", "all-gather"),
    ("c10d::_reduce_scatter_base_", "reduce-scatter"),
    ("c10d::allreduce_", "all-reduce"),
    ("record_param_comms", "other"),
])
def test_collectives_split_by_kind(name, kind):
    """The multi-GPU runs read the all-gather time from this split of the collectives row."""
    assert ps.categorize(name) == "collectives", name
    assert ps.collective_kind(name) == kind


def test_cpu_attribution_keeps_gemms_and_takes_sticky_ancestors():
    hq = frozenset({"_LinearFunction", "_LinearFunctionBackward"})
    fwd = ["FSDP::pre_forward (layers.0)", "_LinearFunction"]
    assert ps.attribute("aten::amax", fwd, hq) == "hybridq"  # the reference quantization's element-wise ops
    assert ps.attribute("aten::mm", fwd, hq) == "gemm"  # the GEMM inside the quantized Linear stays a GEMM
    assert ps.attribute("_LinearFunction", ["FSDP::pre_forward (layers.0)"], hq) == "hybridq"
    assert ps.attribute("aten::bmm", ["aten::scaled_dot_product_attention"], hq) == "attention"
    assert ps.attribute("aten::mul_", ["Optimizer.step#AdamW.step", "aten::_foreach_mul_"], hq) == "optimizer"
    assert ps.attribute("aten::add", ["FSDP::post_forward"], hq) == "elementwise"


def test_union_counts_overlapping_streams_once():
    assert ps.union_us([]) == 0
    assert ps.union_us([(0, 10), (5, 15), (20, 25)]) == 20
    assert ps.union_us([(3, 4), (0, 10)]) == 10


def test_step_stats_lists_slow_steps():
    s = ps.step_stats([0.33, 0.33, 0.34, 0.55, 0.33], [0.1] * 5)
    assert s["median_ms"] == pytest.approx(330)
    assert [j["step"] for j in s["jitter_steps"]] == [3]
    assert s["max_ms"] == pytest.approx(550)


def test_device_copies_of_the_step_ranges_are_not_steps():
    """On CUDA the profiler records each `profile_step#i` range twice: on the host and as a user annotation on the
    GPU timeline. Only the host ranges are steps (counting both halved every per-step number, busy time included)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation, kernels=[], cpu_parent=None, self_cpu_time_total=0)

    events = [event(f"{ps.STEP_MARK}0", DeviceType.CPU, 0, 1000),
              event(f"{ps.STEP_MARK}0", DeviceType.CUDA, 100, 1000, annotation=True),
              event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", DeviceType.CUDA, 200, 500),
              event("triton_poi_fused_add_0", DeviceType.CUDA, 600, 700)]
    r = ps.summarize_events(events, "cuda", 5, frozenset())
    assert r["profiled_steps"] == 1, f"{r['profiled_steps']} steps counted for one profiled step"
    assert r["busy_ms"] == pytest.approx(0.4) and r["idle_ms"] == pytest.approx(0.6), (r["busy_ms"], r["idle_ms"])
    assert r["categories_ms"]["gemm"] == pytest.approx(0.3), r["categories_ms"]


def test_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "prof.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    cmd = [sys.executable, "benchmarks/profile_step.py", "--smoke", "--device", "cpu", "--recipes", "bf16,fp8_tensorwise",
           "--json", str(out), "--trace-dir", str(tmp_path / "traces")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    text = p.stdout
    phases = [l.split(" in ")[0] for l in text.splitlines() if " timed in " in l or " profiled in " in l]
    assert phases == ["[bf16] timed", "[fp8_tensorwise] timed", "[bf16] profiled", "[fp8_tensorwise] profiled"], \
        f"every recipe's unprofiled steps must run before the process's first profiler session: {phases}"
    assert "## CPU op self time per step by category" in text
    header = next(l for l in text.splitlines() if l.startswith("| category"))
    assert "bf16" in header and "fp8_tensorwise" in header and "fp8_tensorwise vs bf16" in header
    for label in list(ps.LABELS.values()) + ["idle (wall - busy)", "host time to issue a step", "aten ops / step"]:
        assert f"| {label}" in text, label
    assert text.count("## top 15 CPU ops (self time)") == 2
    assert "steps > 1.3x median" in text
    doc = json.loads(out.read_text())
    assert {"args", "device", "torch", "hybridq", "world", "categories", "results"} <= set(doc)
    assert [r["recipe"] for r in doc["results"]] == ["bf16", "fp8_tensorwise"]
    for r in doc["results"]:
        assert {"categories_ms", "kernel_total_ms", "step_wall_ms", "busy_ms", "idle_ms", "launches_per_step",
                "hybridq_host_ms", "inside_hybridq_functions_ms", "top", "timed", "allocator",
                "profiled_host_ms", "collectives_ms"} <= set(r)
        assert set(r["collectives_ms"]) == set(ps.COLLECTIVE_KINDS)
        assert set(r["categories_ms"]) == set(ps.CATEGORIES)
        assert r["profiled_steps"] == 2 and r["timed"]["n"] == 3 and 0 < len(r["top"]) <= 15
        assert {"name", "category", "total_ms_per_step", "calls_per_step", "avg_us"} <= set(r["top"][0])
    bf16, fp8 = doc["results"]
    assert bf16["categories_ms"]["hybridq"] == 0 and fp8["categories_ms"]["hybridq"] > 0
    assert bf16["hybridq_function_calls_per_step"] == 0 and fp8["hybridq_function_calls_per_step"] > 0
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["bf16.json", "fp8_tensorwise.json"]
