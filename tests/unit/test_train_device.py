"""Where `autoshard train` puts each rank (autoshard/train/device.py), decided without a GPU: the
device of the local rank, the backend, bf16 by default on GPUs (fused kernels only with --fuse), what was given
kept, too few GPUs named; a runtime moved to another device entirely (tested on the meta device)."""
import pytest
import torch

from autoshard import autoshard
from autoshard.testing.models import build_model
from autoshard.train.device import Placement, move_runtime, placement
from autoshard.train.options import TrainError, parse


def _opts(tmp_path, *extra):
    data = tmp_path / "d.txt"
    data.write_text("text")
    return parse(["--model", "llama", "--data", str(data), "--out", str(tmp_path / "o"), *extra])


def test_auto_takes_the_gpus_when_there_are_any(tmp_path):
    opts = _opts(tmp_path)
    assert placement(opts, {}, cuda_devices=0) == Placement("cpu", "gloo", "fp32", False)
    env = {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}
    assert placement(opts, env, cuda_devices=8) == Placement("cuda:3", "nccl", "bf16", False)    # fused: --fuse


def test_what_is_given_is_kept(tmp_path):
    opts = _opts(tmp_path, "--precision", "fp32", "--fuse")
    assert placement(opts, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2) == Placement("cuda:1", "nccl", "fp32", True)
    cpu = _opts(tmp_path, "--device", "cpu", "--precision", "bf16", "--fuse")
    assert placement(cpu, {}, cuda_devices=8) == Placement("cpu", "gloo", "bf16", True)


def test_too_few_gpus_are_named(tmp_path):
    with pytest.raises(TrainError, match=r"--device cuda: no CUDA GPU is visible here"):
        placement(_opts(tmp_path, "--device", "cuda"), {}, cuda_devices=0)
    with pytest.raises(TrainError, match=r"4 processes on this node but 2 GPU\(s\) visible"):
        placement(_opts(tmp_path), {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, cuda_devices=2)


def test_fp8_is_refused_in_one_line_on_a_gpu_without_fp8_tensor_cores(tmp_path, monkeypatch):
    """An A100 (8.0) has no FP8 tensor cores; an H100 (9.0) and an L4 (8.9) do; the CPU runs FP8
    (slowly, for checking). --fuse composes with it (before, it was refused)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    opts = _opts(tmp_path, "--precision", "fp8")
    for capability, ok in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0, c=capability: c)
        if ok:
            assert placement(opts, {}, cuda_devices=1).precision == "fp8"
        else:
            with pytest.raises(TrainError, match=r"^--precision fp8: NVIDIA A100-SXM4-80GB \(compute capability "
                                                 r"8\.0\) has no FP8 tensor cores"):
                placement(opts, {}, cuda_devices=1)
    assert placement(_opts(tmp_path, "--precision", "fp8", "--device", "cpu"), {}, 0).precision == "fp8"
    assert _opts(tmp_path, "--precision", "fp8", "--fuse").fuse


def test_a_runtime_moves_to_another_device_with_its_graphs(one_process_group):
    """What train does with a model loaded on the CPU from a folder when its ranks run on a GPU:
    here to the meta device, which needs no GPU; every tensor and every device a graph names moves."""
    ids = torch.randint(0, 128, (2, 16))
    rt = autoshard(build_model("llama", layers=2), example_kwargs={"input_ids": ids, "labels": ids}).distributed(mesh=True)
    move_runtime(rt, "meta")
    tensors = list(rt.parameters()) + list(rt.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    named = [a for gm in rt.graph_modules() for n in gm.graph.nodes for a in n.kwargs.values()
             if isinstance(a, torch.device)]
    assert named and all(d.type == "meta" for d in named)
    assert all(p.requires_grad for p in rt.parameters())


def test_the_estimate_is_for_the_hardware_this_runs_on(tmp_path):
    """Regression: every progress line of a CPU run printed an A100 estimate. By default the cost
    model's hardware is the GPU's preset when one describes it, and none on the CPU; --hardware
    names one explicitly."""
    from autoshard.planning.hardware import preset_for_gpu
    from autoshard.train.device import running_hardware
    assert _opts(tmp_path).hardware is None
    assert _opts(tmp_path, "--hardware", "h200").hardware == "h200"
    assert _opts(tmp_path, "--hardware", "cpu").hardware == "cpu"          # this machine, measured
    assert running_hardware(Placement("cpu", "gloo", "fp32", False)) is None
    assert preset_for_gpu("NVIDIA H100 80GB HBM3", 79.2) == "h100-80gb"
    assert preset_for_gpu("NVIDIA A100-SXM4-80GB", 79.2) == "a100-80gb"
    assert preset_for_gpu("NVIDIA A100-SXM4-40GB", 39.4) is None          # the preset's memory is 80 GiB
    assert preset_for_gpu("NVIDIA H200", 139.8) == "h200"
    assert preset_for_gpu("Tesla V100-SXM2-32GB", 31.7) == "v100-32gb"
    assert preset_for_gpu("NVIDIA GeForce RTX 4090", 23.6) is None


@pytest.mark.parametrize("plan", [False, True])
def test_the_example_batch_is_made_where_the_model_was_put(tmp_path, monkeypatch, plan):
    """Regression (the first GPU run, 2026-11-27): the model was moved to cuda:0 for capture but
    its example batch was made on the CPU, and torch.export refused the embedding ("found two
    different devices cuda:0, cpu"). The meta device stands in for the GPU here."""
    import types

    from autoshard.train import loop
    seen = []

    def record(model, **kw):
        seen.extend(t.device.type for t in kw["example_kwargs"].values())
        raise StopIteration                          # the split does not matter here
    monkeypatch.setattr(loop, "autoshard", record)
    opts = _opts(tmp_path, "--seq-len", "16", "--batch", "2", *(["--plan"] if plan else []))
    source = types.SimpleNamespace(model=None, input_name="input_ids", label_name="labels")
    with pytest.raises(StopIteration):
        loop._compile(opts, source, 1, None, "meta")
    assert seen == ["meta", "meta"]
