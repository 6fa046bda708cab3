"""GPU paths: FlashAttention varlen, FP8 linears, NCCL weight links. Skipped without CUDA.

CI has no GPU; these run on a lent GPU machine (``python -m pytest -m gpu``). Tolerances: bf16
keeps 8 mantissa bits, so attention in bf16 is compared with float32 SDPA at atol 2e-2 (values
and gradients here are O(1)); FP8 as in test_precision.py.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlvla3.policy.attention import (
    VARLEN_KERNELS,
    attention,
    available_varlen_kernels,
    backend_name,
    prefer_varlen_kernel,
)
from sft.precision import Float8Linear, fp8_backend
from transport.weight_fanout import Broadcaster
from transport.weights import BUCKET_BYTES, WeightLink, start_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")


def test_a_varlen_kernel_serves_packed_attention_on_cuda():
    assert backend_name(CUDA, torch.bfloat16) in VARLEN_KERNELS


@pytest.mark.parametrize("kernel", list(VARLEN_KERNELS))
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kernel_matches_per_sample_sdpa(kernel, causal, head_dim):
    if kernel not in available_varlen_kernels():
        pytest.skip(f"{kernel} does not load here")
    prefer_varlen_kernel(kernel)
    try:
        if backend_name(CUDA, torch.bfloat16, head_dim) != kernel:
            pytest.skip(f"{kernel} does not serve head dim {head_dim} on this GPU")
        _check_varlen_against_sdpa(causal, head_dim)
    finally:
        prefer_varlen_kernel(None)


def _check_varlen_against_sdpa(causal: bool, dh: int) -> None:
    lengths, heads = [1, 17, 64, 200, 511], 4
    g = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), heads, dh, device=CUDA, generator=g) for _ in range(3))
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA
    )
    weight = torch.randn(sum(lengths), heads, dh, device=CUDA, generator=g)

    packed = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out = attention(*packed, cu_seqlens=cu, max_seqlen=max(lengths), causal=causal)
    (out.float() * weight).sum().backward()

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    outs = [
        F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1)[None] for x in ref_in), is_causal=causal
        )[0].transpose(0, 1)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
    ]
    ref = torch.cat(outs)
    (ref * weight).sum().backward()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(packed, ref_in, strict=True):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_backend(torch.device("cuda")) is None,
    reason="needs a GPU with FP8 tensor cores (sm_89+)",
)
def test_float8_linear_on_gpu_under_autocast():
    torch.manual_seed(0)
    ref = nn.Linear(1024, 512).to(CUDA)
    fp8 = Float8Linear.from_linear(nn.Linear(1024, 512).to(CUDA))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(8, 100, 1024, device=CUDA)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_fp8 = fp8(x_fp8)
    assert y_fp8.dtype == torch.bfloat16
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_fp8.float().backward(grad)

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    assert rel(y_fp8.detach(), y_ref.detach()) < 0.06
    assert rel(x_fp8.grad, x_ref.grad) < 0.12
    assert rel(fp8.weight.grad, ref.weight.grad) < 0.12


NUMEL = BUCKET_BYTES // 4 + 1000  # more than one bucket


def _expected(version: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) * 1e-6 + version


def _cuda_receiver(port: int, gpu: int, versions: int, hostid: str, results: mp.Queue) -> None:
    if hostid:
        os.environ["NCCL_HOSTID"] = hostid
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    link = WeightLink(store, "gpu_link", 1, f"cuda:{gpu}", timeout_s=60)
    out = torch.empty(NUMEL, device=f"cuda:{gpu}")
    for _ in range(versions):
        version = link.recv(out)
        digest = hashlib.sha256(out.cpu().numpy().tobytes()).hexdigest()
        results.put((link.backend, version, digest))


@pytest.mark.parametrize("distinct_host_ids", [False, True])
def test_cuda_weight_link_delivers_identical_versions(monkeypatch, distinct_host_ids):
    """NCCL between two GPUs. On a one-GPU machine both ends share the GPU, which NCCL refuses
    unless the two processes give it different ``NCCL_HOSTID``s (then it links them over its
    socket transport); without them the link falls back to gloo on the CUDA tensors. Every
    version must arrive intact either way."""
    gpu = 1 if torch.cuda.device_count() > 1 else 0
    if distinct_host_ids:
        monkeypatch.setenv("NCCL_HOSTID", "rlvla3-test-broadcaster")
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    else:
        monkeypatch.delenv("NCCL_HOSTID", raising=False)
    ctx = mp.get_context("spawn")
    store = start_store("127.0.0.1", timeout_s=60)
    results: mp.Queue = ctx.Queue()
    hostid = "rlvla3-test-server" if distinct_host_ids else ""
    proc = ctx.Process(target=_cuda_receiver, args=(store.port, gpu, 2, hostid, results))
    proc.start()
    try:
        broadcaster = Broadcaster(store, device="cuda:0", timeout_s=60)
        broadcaster.add("gpu_link")
        for version in (0, 1):
            assert broadcaster.publish(version, _expected(version).to(CUDA)) == []
        got = [results.get(timeout=120) for _ in range(2)]
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    backend = "nccl" if gpu == 1 or distinct_host_ids else "gloo"
    assert broadcaster.links["gpu_link"].backend == backend
    want = [
        (backend, v, hashlib.sha256(_expected(v).numpy().tobytes()).hexdigest()) for v in (0, 1)
    ]
    assert got == want
