"""tools/: the parts that run without a GPU."""
import importlib.util
import re
from pathlib import Path

import pytest
from support import INTERPRETED


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tuning_table_reads_the_tuners_log():
    log = ("conv2d launches conv2d_gemm_cl_dw__bf16__3_3\n"
           "tuning conv2d_cl_dw (32, 64, 'torch.bfloat16', True): {'Config(block_m=64, block_n=64, block_k=64, "
           "num_warps=4, num_stages=3, split=30)': 0.0778, 'Config(block_m=64, block_n=64, block_k=64, num_warps=8, "
           "num_stages=3, split=30)': 0.0728}\n")
    assert _tool("tuning_table").table(log).splitlines() == [
        "conv2d_cl_dw (32, 64, 'torch.bfloat16', True)",
        "   0 64,64,64,4,3,30                   77.8 us",
        "  *1 64,64,64,8,3,30                   72.8 us",
    ]


def test_step_profile_groups_kernels_by_name():
    group_of = _tool("resnet_step_profile").group_of
    assert group_of("batch_norm2d_train_backward_dx_entry_point") == "batch norm"
    assert group_of("conv2d_gemm_cl_dx_entry_point") == "conv dx"
    assert group_of("conv2d_pointwise_dw_entry_point") == "conv dw"
    assert group_of("sm90_xmma_wgrad_indexed_implicit_gemm_bf16bf16") == "conv dw"
    assert group_of("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>") == "layout copy"
    assert group_of("conv2d_gemm_cl_forward_entry_point") == "conv fwd"
    assert group_of("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>") == "other"


def test_bn_sweep_configs_start_with_the_tuners_and_fit_their_warps():
    tool = _tool("bn_grouped_sweep")
    found = tool.configs(32, 2048, 49, 4)
    tuners = tool.bn.grouped_candidates(32, 2048, 49, 4, tool.batch_norm_plan(32, 2048, 49, element_size=4).channels)
    assert found[:len(tuners)] == tuners
    assert len(found) == len(set(found)) > 10
    assert all(c.block_m * c.block_n // c.num_warps >= 64 for c in found[len(tuners):])


def test_kernel_sass_counts_opcodes_of_a_compiled_kernel():
    tool = _tool("kernel_sass")
    listing = ("        /*0040*/                   LDG.E.U16 R3, desc[UR4][R4.64] ;\n"
               "        /*0050*/              @!P0 LDG.E R5, desc[UR4][R6.64+0x4] ;\n"
               "        /*10060*/                  FFMA R7, R3, R5, R7 ;\n")  # past 64 KiB of code
    assert tool.opcode_counts(listing) == {"LDG": 2, "FFMA": 1}
    assert tool.registers(" Function k:\n  REG:40 STACK:0 SHARED:0") == 40
    report = tool.main(["Conv2dDwReduce", "fp32", "False", "1", "1", "8", "256"]).splitlines()
    assert report[0] == "conv2d_dw_reduce__fp32__0__1__1__8__256"
    count, regs = re.fullmatch(r"(\d+) instructions, (\d+) registers per thread", report[1]).groups()
    assert int(count) > 0 and int(regs) > 0
    assert "LDG" in report[2] and "STG" in report[2]  # the partial rows read, dw written


def test_depthwise_sweep_sets_tiles_inside_its_block_only():
    tool = _tool("depthwise_sweep")
    before = tool.tuning.depthwise_tile(8192, 28, 28)
    assert tool.plan.gather_columns_fit(1, 3, 1, 28, 32)
    with tool.tiles(64, 8, 2, False):
        inside = tool.tuning.depthwise_tile(8192, 28, 28)
        assert inside.num_warps == 2 and inside.rows <= 8
        assert not tool.plan.gather_columns_fit(1, 3, 1, 28, 32)
    assert tool.tuning.depthwise_tile(8192, 28, 28) == before
    assert tool.plan.gather_columns_fit(1, 3, 1, 28, 32)
    assert tool.CONFIGS[0] == (tool.tuning.DEPTHWISE_LANES, tool.tuning.DEPTHWISE_BAND, 4, True)  # the library's


def test_conv_dw_sweep_targets_programs_per_sm():
    """Each tile set's splits start at most its programs-per-SM target on the given SMs (floor), and
    the kernels the sweep builds from them exist for its layers."""
    import torch

    tool = _tool("conv_dw_sweep")
    configs = list(tool.sweep_configs(64, torch.bfloat16, 132))
    assert len(configs) == len(tool.TILE_SETS) * len(tool.PROGRAMS_PER_SM)
    for (kind, config), per_sm in zip(configs, tool.PROGRAMS_PER_SM * len(tool.TILE_SETS)):
        tiles = (64 // config.block_m) * (64 // config.block_n) * (9 // config.taps)
        assert tiles * config.split <= max(per_sm * 132, tiles) and config.block_k == 64
    problem = tool.Problem((32, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.bfloat16, False)
    assert {type(problem.tma_dw_kernel(c, False) if k == "tma" else problem.cl_dw_kernel(c, False)).__name__
            for k, c in configs} == {"Conv2dTmaDw", "Conv2dGemmClDw"}


@pytest.mark.skipif(not INTERPRETED, reason="the tool drives CPU tensors through Triton's interpreter (stubbed "
                    "launches); a compiled process refuses CPU tensors at every launch, by design")
def test_host_overhead_op_calls_after_the_first_list_no_tuning_candidates(monkeypatch, tmp_path):
    """On the GPU's code path (launches stubbed), every op's first call tunes its kinds; later calls find
    the choices remembered and never build the candidate lists, the cost an eager loop would pay per call."""
    tool = _tool("host_overhead")
    monkeypatch.setenv("NNKERNELS_CACHE_DIR", str(tmp_path))
    tool.stub_launches(monkeypatch.setattr)
    tool.gpu_path(monkeypatch.setattr)
    listed, choose = [], tool.tuning.choose

    def choose_counting_lists(kind, key, candidates, run):
        return choose(kind, key, lambda: listed.append(kind) or candidates(), run)

    monkeypatch.setattr(tool.tuning, "choose", choose_counting_lists)
    calls = tool.ops()
    for call in calls.values():
        call()
    assert {"conv2d_cl_forward", "conv2d_tma_dw", "conv2d_pointwise", "conv2d_pointwise_dx", "conv2d_pointwise_dw",
            "avg_pool2d_lanes_forward", "avg_pool2d_lanes_backward", "batch_norm_train_forward_grouped"} <= set(listed)
    listed.clear()
    for call in calls.values():
        call()
    assert listed == []
