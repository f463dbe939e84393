"""The family registry: every architecture maps to the family that declares it, every family fulfils
the abstract contract, and every family has a tiny-model greedy-parity test (structurally: a test
marked `@parity_test` in tests/parity.py, which fails unless it compares tokens through the shared
helper)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import parity
from vlmctl.models.base import FamilyProcessor, VLMFamily
from vlmctl.models.registry import ARCHITECTURES, FAMILIES, all_families, detect_family, family_class

TESTS = Path(__file__).parent


def test_every_registered_family_has_a_tiny_parity_test():
    for path in sorted(TESTS.glob("test_*.py")):  # importing a test module registers its parity tests
        importlib.import_module(path.stem)
    missing = sorted(set(FAMILIES) - set(parity.PARITY_TESTS))
    assert not missing, f"families without a tiny-model parity test (@parity_test): {missing}"
    unknown = sorted(set(parity.PARITY_TESTS) - set(FAMILIES))
    assert not unknown, f"@parity_test names unknown families: {unknown}"
    for fam, tests in parity.PARITY_TESTS.items():
        for t in tests:
            module = importlib.import_module(t.__module__)
            # the marked function is what pytest collects (a test at module level, named test_*)
            assert t.__name__.startswith("test_") and getattr(module, t.__name__) is t, (fam, t)


def test_the_parity_mark_fails_a_test_that_compares_nothing():
    @parity.parity_test("nothing")
    def test_forgets_to_compare():
        return None

    try:
        with pytest.raises(AssertionError, match="never called assert_greedy_parity"):
            test_forgets_to_compare()

        @parity.parity_test("nothing")
        def test_compares(x):
            parity.assert_greedy_parity([5, 6], [5, 6, 2, 9], eos=2)
            return x

        assert test_compares(3) == 3
        assert list(inspect.signature(test_compares).parameters) == ["x"]  # pytest still sees the fixtures
        with pytest.raises(AssertionError, match="greedy tokens"):
            parity.assert_greedy_parity([5, 7], [5, 6, 2], eos={2, 3})
    finally:
        parity.PARITY_TESTS.pop("nothing", None)


def test_each_architecture_maps_to_the_family_declaring_it():
    declared = {}
    for name, cls in all_families().items():
        assert cls.architectures, name
        for arch in cls.architectures:
            assert arch not in declared, f"{arch} is claimed by two families"
            declared[arch] = name
    assert declared == ARCHITECTURES
    for arch, name in ARCHITECTURES.items():
        assert detect_family({"architectures": ["SomethingElse", arch]}).name == name


def test_families_fulfil_the_abstract_contract():
    """Every registered family instantiates (no abstract hook left out), and its processor class
    implements the processor's abstract hooks; the base classes themselves cannot be instantiated."""
    with pytest.raises(TypeError):
        VLMFamily()
    for name in FAMILIES:
        fam = family_class(name)()  # TypeError if a family leaves an abstract hook out
        assert fam.name == name and not type(fam).__abstractmethods__
    import vlmctl.models.gemma3 as g
    import vlmctl.models.idefics3 as i
    import vlmctl.models.internvl as iv
    import vlmctl.models.llava as ll
    import vlmctl.models.llava_anyres as la
    import vlmctl.models.qwen2_vl as q

    import vlmctl.models.llava_onevision as lo
    import vlmctl.models.mllama as ml

    for cls in (ll.LlavaProcessorAdapter, la.AnyresProcessorAdapter, q.QwenProcessorAdapter,
                iv.InternVLProcessorAdapter, i.Idefics3ProcessorAdapter, g.Gemma3ProcessorAdapter,
                lo.OnevisionProcessorAdapter, ml.MllamaProcessorAdapter):
        assert issubclass(cls, FamilyProcessor) and not cls.__abstractmethods__, cls
    # The families that take videos supply the video hooks (the base's only raise).
    video_processors = {"qwen2_vl": q.QwenProcessorAdapter, "qwen2_5_vl": q.QwenProcessorAdapter,
                        "llava_onevision": lo.OnevisionProcessorAdapter}
    assert {name for name in FAMILIES if family_class(name).video} == set(video_processors)
    for cls in video_processors.values():
        for hook in ("video_items", "video_text"):
            assert getattr(cls, hook) is not getattr(FamilyProcessor, hook), (cls, hook)


def test_detection_imports_one_family_module():
    """detect_family is a dict lookup: resolving one architecture imports that family's module only."""
    import subprocess
    import sys

    code = ("import sys; from vlmctl.models.registry import detect_family; "
            "detect_family({'architectures': ['Gemma3ForConditionalGeneration']}); "
            "print(sorted(m for m in sys.modules if m.startswith('vlmctl.models.') and m not in "
            "('vlmctl.models.base', 'vlmctl.models.registry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["vlmctl.models.gemma3"]


def test_equal_but_near_ties_accepts_only_a_near_tie_taken_the_other_way():
    from parity import assert_equal_but_near_ties

    plain = [[5, 6, 7], [1, 2, 3]]
    lps = [[{"top": [(5, -0.1), (9, -3.0)]}, {"top": [(6, -0.50), (8, -0.52)]}, {"top": [(7, -0.2), (1, -2.0)]}],
           [{"top": [(1, -0.1), (2, -3.0)]}] * 3]
    assert assert_equal_but_near_ties(plain, plain, lps) == 0
    assert assert_equal_but_near_ties([[5, 8, 4], [1, 2, 3]], plain, lps) == 1  # 8 was 0.02 nats behind 6
    tie = [lps[0], [lps[1][0], {"top": [(8, -0.5), (6, -0.5)]}, lps[1][2]]]  # exact, listed either way round
    assert assert_equal_but_near_ties([[5, 6, 7], [1, 8, 3]], [[5, 6, 7], [1, 6, 3]], tie) == 1
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_equal_but_near_ties([[5, 6, 1], [1, 2, 3]], plain, lps)  # 1 was 1.8 nats behind 7
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_equal_but_near_ties([[5, 9, 7], [1, 2, 3]], plain, lps)  # 9 is not the runner-up there


def test_vision_modules_are_built_without_their_parameters_then_given_the_weights(tmp_path):
    """`vision_module_with_weights` builds the wrapper with meta parameters (no memory, no random init) and
    real buffers, then assigns the file's tensors; a weight the file lacks is a checkpoint error, and a
    module another thread builds meanwhile gets real parameters."""
    import threading

    import torch
    from safetensors.torch import save_file

    from vlmctl.errors import CheckpointError
    from vlmctl.models.base import parameters_on_meta

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 3)
            self.register_buffer("ids", torch.arange(5), persistent=False)

    seen = {}
    with parameters_on_meta():
        inside = Tower()
        worker = threading.Thread(target=lambda: seen.setdefault("other", Tower()))
        worker.start()
        worker.join()
    assert inside.proj.weight.is_meta and not inside.ids.is_meta and inside.ids.tolist() == [0, 1, 2, 3, 4]
    assert not seen["other"].proj.weight.is_meta
    assert not Tower().proj.weight.is_meta  # the patch is gone afterwards

    w = torch.randn(3, 4, dtype=torch.float16)
    b = torch.randn(3, dtype=torch.float16)
    save_file({"proj.weight": w, "proj.bias": b, "extra": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    m = VLMFamily.vision_module_with_weights(Tower, tmp_path, skip=("extra",))
    assert torch.equal(m.proj.weight, w) and torch.equal(m.proj.bias, b) and m.ids.tolist() == [0, 1, 2, 3, 4]
    x = torch.randn(2, 4)
    assert torch.allclose(m.proj.float()(x), x @ w.float().T + b.float())
    save_file({"proj.weight": w}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        VLMFamily.vision_module_with_weights(Tower, tmp_path)
