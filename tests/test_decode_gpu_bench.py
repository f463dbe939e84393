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


def test_timeline_charges_each_kernel_what_it_adds_to_the_span(monkeypatch):
    """`--timeline`'s arithmetic on hand-made traces: a kernel launched early (PDL) is charged only for how far
    its end passes the latest end before it, one that ends inside another's time for nothing, and the charges
    sum to the step's span; idle gaps longer than `gap` cut the trace into steps."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import decode_gpu as D

    step = [("norm", 0.0, 2.0), ("qkv", 1.0, 12.0), ("attn", 5.0, 20.0), ("o", 6.0, 19.0), ("norm", 19.5, 21.0)]
    assert D.chain_contributions(step) == [2.0, 10.0, 8.0, 0.0, 1.0]
    assert sum(D.chain_contributions(step)) == step[-1][2] - step[0][1]
    later = [(name, start + 1000.0, end + 1000.0) for name, start, end in step]
    assert D.split_steps(later[::-1] + step, gap=500.0) == [step, later]
    assert D.split_steps(step + later, gap=2000.0) == [step + later]
