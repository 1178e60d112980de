"""nnkernels.nn.SyncBatchNorm over two gloo ranks (separate processes, Triton's interpreter on the CPU) against
ONE batch norm over the global batch in float64: output, dx, the sum over ranks of dweight and dbias, and the
running statistics, for equal and unequal per-rank batches, a rank with batch 0 and channels cut into chunks;
ranks that disagree on the channel count or dtype raise on both ranks. Also convert and convert_sync_batchnorm
in one process. One pair of processes runs every two-rank case (`two_ranks`)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nnkernels.nn as nnk
from support import DEVICE

ROOT = Path(__file__).resolve().parents[1]
C, H, W = 3, 5, 5
# (name, per-rank batch sizes, chunked): chunked cuts each channel into several chunks (the merge kernel's path)
CASES = [("equal", (3, 3), False), ("unequal", (4, 1), False), ("empty_rank", (0, 5), False),
         ("chunked", (5, 2), True)]


def global_case(name, sizes):
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(sum(sizes), C, H, W, generator=generator) * 2.0 + 5.0  # |mean| > std: the shifts matter
    dy = torch.randn(sum(sizes), C, H, W, generator=generator)
    params = {key: torch.randn(C, generator=generator) for key in ("weight", "bias", "running_mean")}
    params["running_var"] = torch.rand(C, generator=generator) + 0.5
    return x, dy, params


def worker(rank, init_file, out_dir):
    """One rank: every case of CASES, then the mismatches; results saved to out_dir/rank<r>.pt."""
    import torch.distributed as dist
    from _pytest.monkeypatch import MonkeyPatch

    from nnkernels.functional import batchnorm_algorithms, clear_plans, sync_batchnorm
    from support import allocations_by_the_ops

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    patch = MonkeyPatch()
    allocations_by_the_ops(patch, lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max, dtype=dtype, device=device))
    results = {}
    for name, sizes, chunked in CASES:
        if chunked:
            patch.setattr(sync_batchnorm, "split_candidates",
                          lambda step, machine: [batchnorm_algorithms.SplitConfig(16, 8, 4)])
            clear_plans()
        x, dy, params = global_case(name, sizes)
        start = sum(sizes[:rank])
        x = x[start:start + sizes[rank]].clone().requires_grad_(True)
        layer = nnk.SyncBatchNorm(C, momentum=0.3)
        with torch.no_grad():
            for key, value in params.items():
                getattr(layer, key).copy_(value)
        y = layer(x)
        y.backward(dy[start:start + sizes[rank]])
        grads = {key: None if getattr(layer, key).grad is None else getattr(layer, key).grad.clone()
                 for key in ("weight", "bias")}
        chunks = sync_batchnorm._plan(x, 2).chunks if sizes[rank] else None
        results[name] = dict(y=y.detach(), dx=x.grad, running_mean=layer.running_mean.clone(),
                             running_var=layer.running_var.clone(), chunks=chunks, **grads)
    patch.undo()
    for name, channels, dtype in (("channels", (3, 4), (torch.float32,) * 2),
                                  ("dtype", (3, 3), (torch.float32, torch.float16))):
        layer = nnk.SyncBatchNorm(channels[rank])
        try:
            layer(torch.randn(2, channels[rank], 4, 4).to(dtype[rank]))
            results[name] = None
        except Exception as error:  # noqa: BLE001  (the test reads the kind and the words)
            results[name] = (type(error).__name__, str(error))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_two_ranks(out):
    env = dict(os.environ, TRITON_INTERPRET="1", NNKERNELS_TUNE="off",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    code = "import sys, test_sync_batch_norm as t; t.worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])"
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r), str(out / "init"), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [rank.communicate(timeout=300)[0] for rank in ranks]
    for rank, log in zip(ranks, logs):
        assert rank.returncode == 0, log[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def reference(name, sizes):
    x, dy, params = global_case(name, sizes)
    x64 = x.double().requires_grad_(True)
    weight = params["weight"].double().requires_grad_(True)
    bias = params["bias"].double().requires_grad_(True)
    running_mean, running_var = params["running_mean"].double(), params["running_var"].double()
    y = torch.nn.functional.batch_norm(x64, running_mean, running_var, weight, bias, True, 0.3, 1e-5)
    y.backward(dy.double())
    return dict(y=y.detach(), dx=x64.grad, weight=weight.grad, bias=bias.grad, running_mean=running_mean,
                running_var=running_var)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_case(two_ranks, name, sizes, chunked):
    ref = reference(name, sizes)
    ranks = [r[name] for r in two_ranks]
    for key in ("y", "dx"):
        out = torch.cat([r[key] if r[key] is not None else torch.zeros(0, C, H, W) for r in ranks])
        assert not torch.isnan(out).any(), f"{name} {key}: unwritten elements"
        assert rel(out, ref[key]) <= 1e-5, f"{name} {key}: relative error {rel(out, ref[key]):.2e}"
    for key in ("weight", "bias"):
        total = sum(r[key].double() for r in ranks if r[key] is not None)
        assert rel(total, ref[key]) <= 1e-5, f"{name} d{key} summed over ranks: relative error {rel(total, ref[key]):.2e}"
    for key in ("running_mean", "running_var"):
        for rank, r in enumerate(ranks):
            assert rel(r[key], ref[key]) <= 1e-5, f"{name} rank {rank} {key}: relative error {rel(r[key], ref[key]):.2e}"
    if chunked:
        assert all(r["chunks"] is None or r["chunks"] > 1 for r in ranks)


def check_disagreements(two_ranks):
    for rank, results in enumerate(two_ranks):
        assert results["channels"] is not None, f"rank {rank}: no error for mismatched channel counts"
        assert "channel count" in results["channels"][1] and "[3, 4]" in results["channels"][1]
        assert results["dtype"] is not None and results["dtype"][0] == "TypeError", results["dtype"]
        assert "dtype" in results["dtype"][1]


def test_two_gloo_ranks_match_one_batch_norm_and_refuse_disagreements(tmp_path):
    """One test, so that one pair of processes (one pytest worker) runs every two-rank case."""
    two_ranks = run_two_ranks(tmp_path)
    for name, sizes, chunked in CASES:
        check_case(two_ranks, name, sizes, chunked)
    check_disagreements(two_ranks)


def test_convert_swaps_torch_sync_batch_norm_with_its_state():
    torch_layer = torch.nn.SyncBatchNorm(C, momentum=0.2)
    with torch.no_grad():
        for tensor in (torch_layer.weight, torch_layer.bias, torch_layer.running_mean):
            tensor.copy_(torch.randn(C))
    model = nnk.convert(torch.nn.Sequential(torch_layer))
    layer = model[0]
    assert type(layer) is nnk.SyncBatchNorm and model.nnkernels_summary.swapped["SyncBatchNorm"] == 1
    assert layer.weight is torch_layer.weight and layer.running_mean is torch_layer.running_mean
    assert list(layer.state_dict()) == list(torch_layer.state_dict())


def test_convert_sync_batchnorm_turns_batch_norms_into_ours():
    torch_bn, our_bn = torch.nn.BatchNorm2d(C, eps=1e-3), nnk.BatchNorm2d(C, affine=False)
    torch_bn.eval()
    model = nnk.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch_bn, our_bn), process_group=None)
    assert [type(m) for m in model] == [nnk.SyncBatchNorm, nnk.SyncBatchNorm]
    assert model[0].weight is torch_bn.weight and model[0].running_var is torch_bn.running_var
    assert model[0].eps == 1e-3 and not model[0].training and model[1].weight is None
    assert isinstance(nnk.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm2d(C)), nnk.SyncBatchNorm)
    x = torch.randn(2, C, 4, 4, device=DEVICE)
    model, torch_bn = model.to(DEVICE), torch_bn.to(DEVICE)
    assert torch.allclose(model[0](x), torch_bn(x), atol=1e-5)  # no process group: batch norm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DDP takes SyncBatchNorm layers on GPU modules only")
def test_ddp_example_with_sync_bn_one_step_on_two_gloo_ranks(tmp_path):
    env = dict(os.environ, NNKERNELS_TUNE="off",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "examples" / "train_ddp.py"), "--backend", "gloo", "--model", "tiny", "--sync-bn",
               "--steps", "1", "--batch-size", "6", "--image-size", "8", "--save-params", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) > 0
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"ranks disagree on {name}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nccl needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_nccl_rank_matches_batch_norm_in_float64(dtype, poisoned_outputs):
    """One process, one nccl rank: the synchronising path itself (forced: the module takes plain batch norm with
    one rank) and the module both equal F.batch_norm over the same batch in float64, output, dx, dweight, dbias and
    the running statistics; the ops' buffers start as NaN."""
    import torch.distributed as dist

    from nnkernels.functional.sync_batchnorm import sync_batch_norm

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        x64, dy64, params = global_case("nccl", (6,))
        x64, dy64 = x64.double(), dy64.double()
        x = x64.to("cuda", dtype).requires_grad_()
        dy = dy64.to("cuda", dtype)
        reference_x = x.detach().double().cpu().requires_grad_()
        weight64, bias64 = (params[key].double().requires_grad_() for key in ("weight", "bias"))
        mean64, var64 = params["running_mean"].double(), params["running_var"].double()
        expected = torch.nn.functional.batch_norm(reference_x, mean64, var64, weight64, bias64, True, 0.3, 1e-5)
        expected.backward(dy.double().cpu())
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2

        def close(got, want, name):
            error = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
            assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"

        for way in ("collectives", "module"):
            weight, bias = (params[key].cuda().requires_grad_() for key in ("weight", "bias"))
            mean, var = params["running_mean"].cuda(), params["running_var"].cuda()
            x.grad = None
            if way == "collectives":
                y = sync_batch_norm(x, mean, var, weight, bias, 0.3, 1e-5, dist.group.WORLD, 1)
            else:
                layer = nnk.SyncBatchNorm(C, momentum=0.3).cuda()
                with torch.no_grad():
                    for name, value in (("weight", weight), ("bias", bias), ("running_mean", mean),
                                        ("running_var", var)):
                        getattr(layer, name).copy_(value)
                y = layer(x)
                weight, bias, mean, var = layer.weight, layer.bias, layer.running_mean, layer.running_var
            y.backward(dy)
            for name, got, want in (("y", y, expected), ("dx", x.grad, reference_x.grad),
                                    ("dweight", weight.grad, weight64.grad), ("dbias", bias.grad, bias64.grad),
                                    ("running_mean", mean, mean64), ("running_var", var, var64)):
                close(got.detach(), want.detach(), f"{way} {name}")
    finally:
        if owns_group:
            dist.destroy_process_group()


@pytest.mark.parametrize("group", [False, True], ids=["no-process-group", "one-rank-gloo-group"])
def test_fullgraph_compile_on_one_process_matches_batch_norm(group):
    """torch.compile(fullgraph=True) over a model with SyncBatchNorm on one process (no group, or a group of one
    rank: both take plain batch norm, as torch's SyncBatchNorm does) traces with no break and trains as
    torch's BatchNorm2d: output, the conv's weight gradient, running statistics."""
    import torch.distributed as dist

    if group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ours = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), nnk.SyncBatchNorm(4), torch.nn.ReLU())
        theirs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        theirs.load_state_dict(ours.state_dict())
        ours, theirs = ours.to(DEVICE), theirs.to(DEVICE)
        x = torch.randn(2, 3, 6, 6, device=DEVICE)
        y = torch.compile(ours, fullgraph=True, backend="aot_eager")(x)
        y.sum().backward()
        y_ref = theirs(x)
        y_ref.sum().backward()
        assert torch.allclose(y, y_ref, atol=1e-5)
        assert torch.allclose(ours[0].weight.grad, theirs[0].weight.grad, atol=1e-4)
        assert torch.allclose(ours[1].running_var, theirs[1].running_var, atol=1e-6)
    finally:
        if group:
            dist.destroy_process_group()
