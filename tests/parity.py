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


def assert_equal_but_near_ties(got: list[list[int]], plain: list[list[int]], plain_logprobs: list[list[dict]],
                               margin: float = 0.05) -> int:
    """Greedy runs `got` equal the `plain` run, except that a sequence may leave it at a near-tie: a
    step where plain's top two tokens were within `margin` nats and `got` took the second. In fp16
    on a GPU, rows batched or chunked differently go through differently shaped GEMMs and round
    differently, so a near-tie can go either way; anything else is a bug. `plain_logprobs`: the
    plain run's Completion.logprobs with at least 2 top entries (an exact tie may list the two in
    either order). Returns the number of such ties."""
    ties = 0
    for i, (g, p, lps) in enumerate(zip(got, plain, plain_logprobs, strict=True)):
        if g == p:
            continue
        assert len(g) == len(p), f"sequence {i}: {len(g)} tokens vs the plain run's {len(p)}"
        j = next(k for k in range(len(p)) if g[k] != p[k])
        (t1, l1), (t2, l2) = lps[j]["top"][:2]
        assert {p[j], g[j]} == {t1, t2} and l1 - l2 < margin, (
            f"sequence {i} leaves the plain run at token {j} ({g[j]} for {p[j]}); the plain run's top two "
            f"there: {t1} ({l1:.4f}), {t2} ({l2:.4f}): not a near-tie within {margin} nats")
        ties += 1
    return ties
