"""The one greedy-parity check of every family's tiny-model test, and the record of which test proves
which family (tests/test_registry.py checks that every registered family has one).

A family's parity test is marked `@parity_test("family", ...)` and compares vlmctl's greedy tokens
with transformers' `generate` through `assert_greedy_parity`. The mark wraps the test: a marked
test that finishes without having called `assert_greedy_parity` fails, so a parity test cannot
silently stop comparing tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

# family name -> the test functions (as collected) that prove its parity
PARITY_TESTS: dict[str, list] = {}
_calls = [0]


def strip_eos(ids: list[int], eos) -> list[int]:
    """`ids` up to (not including) the first end-of-sequence id; `eos`: one id or several."""
    stops = set(eos) if isinstance(eos, Iterable) else {eos}
    for i, t in enumerate(ids):
        if t in stops:
            return list(ids[:i])
    return list(ids)


def assert_greedy_parity(got: list[int], ref: list[int], eos) -> None:
    """vlmctl's greedy tokens `got` equal the new tokens of transformers' `generate` (`ref`), which run
    on past the first EOS vlmctl stops at."""
    _calls[0] += 1
    expected = strip_eos(ref, eos)
    assert list(got) == expected, f"vlmctl's greedy tokens {list(got)} != transformers' {expected}"


def parity_test(*families: str):
    """Mark a test as the tiny-model greedy-parity test of `families`."""
    def mark(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            before = _calls[0]
            result = fn(*args, **kwargs)
            assert _calls[0] > before, f"{fn.__name__} is a parity test but never called assert_greedy_parity"
            return result

        wrapper.parity_families = families
        for f in families:
            PARITY_TESTS.setdefault(f, []).append(wrapper)
        return wrapper

    return mark
