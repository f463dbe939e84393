"""benchmarks/decode_gpu.py on the CPU (--smoke): what its GPU runs depend on beyond the figures it prints."""
from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path


def test_each_decoder_is_freed_before_the_next_is_built(monkeypatch):
    """The fp16 decoder, with a KV pool sized to most of the GPU, must be gone before the AWQ decoder is
    built. In session 33 a `--without` variant's lambda held it as a default argument, and on an H200 the AWQ
    build ran out of memory."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import decode_gpu as D

    built = []
    make = D.make_decoder

    def tracked(*args, **kwargs):
        gc.collect()
        alive = [ref for ref in built if ref() is not None]
        assert not alive, "an earlier decoder is still referenced while the next one is built"
        dec = make(*args, **kwargs)
        built.append(weakref.ref(dec))
        return dec

    monkeypatch.setattr(D, "make_decoder", tracked)
    monkeypatch.setattr(sys, "argv", ["decode_gpu.py", "--smoke", "--awq", "--batches", "1", "--steps", "2",
                                      "--hf-batches", "--without", "norms", "attention-work", "--attn-splits", "2"])
    D.main()
    assert len(built) == 2  # fp16, then AWQ


def test_attention_work_left_out_keeps_a_kernel_that_passes_q(monkeypatch, triton_device):
    """`--without attention-work`'s kernel (the attention's launch, none of its work) hands o exactly q's heads
    of each qkv row (on the CPU through Triton's interpreter)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import decode_gpu as D
    import torch

    n_q, n_kv, d = 4, 2, 16
    qkv = torch.randn(3, (n_q + 2 * n_kv) * d + 8, device=triton_device)[:, :-8]  # rows with a stride of their own
    out = torch.empty(3, n_q, d, device=triton_device)
    D._pass_q_kernel[(3, n_q)](qkv, out, qkv.stride(0), D=d)
    assert torch.equal(out, qkv[:, :n_q * d].reshape(3, n_q, d))
