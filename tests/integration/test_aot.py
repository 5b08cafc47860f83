"""AOTInductor packages of the compiled step's functions (model/runtime/aot.py): built
once per signature, kept on disk, loaded by the next process, rebuilt when torn."""

from __future__ import annotations

import os

import pytest
import torch

from model.runtime import aot

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # it builds AOTInductor packages (~25 s)


def _mix(x, weight, bias, scale: float, square: bool):
    """A function of tensors with non-tensor arguments baked into its package."""
    y = torch.nn.functional.linear(x, weight) * scale
    if bias is not None:
        y = y + bias
    return (y * y if square else y), x.sum(-1)


TOKENS = {0: {0: aot.Dynamic("n", 1, 16)}}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    directory = tmp_path_factory.mktemp("aot")
    function = aot.AotFunction(_mix, directory, "test")
    weight = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(1))
    function("a", lambda: TOKENS, x, weight, None, 0.5, True)
    return directory, function, weight


def test_a_package_runs_every_token_count_of_its_range_as_the_function_does(built):
    _, function, weight = built
    for n in (1, 2, 7, 16):
        x = torch.randn(n, 4)
        got, want = function("a", lambda: TOKENS, x, weight, None, 0.5, True), _mix(x, weight, None, 0.5, True)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.allclose(g, w, atol=1e-6)
    # Views: an offset, every other column, a broadcast row, both; the kernels assume
    # contiguous inputs (a strided one gives a wrong sum, not an error), so they are copied.
    for x in (torch.randn(10, 4)[3:5], torch.randn(3, 8)[:, ::2], torch.randn(1, 4).expand(3, 4),
              torch.randn(4, 8)[1:3, 1::2]):
        got, want = function("a", lambda: TOKENS, x, weight, None, 0.5, True), _mix(x, weight, None, 0.5, True)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.allclose(g, w, atol=1e-6)


def test_a_call_that_does_not_fit_its_package_raises_and_runs_nothing(built):
    """Sizes other than the dynamic ones are the package's: a call with another one
    would read past its buffers, so it is refused, naming the size."""
    _, function, weight = built
    with pytest.raises(ValueError, match=r"_mix \('a'\): argument 0 has shape \(2, 3\); its package takes size 1: 4"):
        function("a", lambda: TOKENS, torch.randn(2, 3), weight, None, 0.5, True)
    with pytest.raises(ValueError, match=r"argument 0 has shape \(2, 2, 4\); its package takes rank 2"):
        function("a", lambda: TOKENS, torch.randn(2, 2, 4), weight, None, 0.5, True)
    x = torch.randn(3, 4)
    assert torch.allclose(function("a", lambda: TOKENS, x, weight, None, 0.5, True)[0],
                          _mix(x, weight, None, 0.5, True)[0], atol=1e-6)


def test_variants_of_one_signature_share_a_package_and_other_arguments_build_another(built):
    directory, function, weight = built
    assert len(function.built) == 1
    function("b", lambda: TOKENS, torch.randn(2, 4), weight.clone(), None, 0.5, True)  # same signature
    assert len(function.built) == 1 and len(list(directory.glob("*.pt2"))) == 1
    x = torch.randn(2, 4)
    got = function("c", lambda: TOKENS, x, weight, torch.ones(5), 2.0, False)  # a bias and other statics
    assert len(function.built) == 2 and len(list(directory.glob("*.pt2"))) == 2
    assert torch.allclose(got[0], _mix(x, weight, torch.ones(5), 2.0, False)[0], atol=1e-6)


def test_a_new_process_loads_the_package_and_a_torn_one_is_built_again(built):
    directory, _, weight = built
    x = torch.randn(3, 4)
    again = aot.AotFunction(_mix, directory, "test")
    want = _mix(x, weight, None, 0.5, True)[0]
    assert torch.allclose(again("a", lambda: TOKENS, x, weight, None, 0.5, True)[0], want, atol=1e-6)
    assert again.built == {}  # loaded, not built
    path = next(p for p in directory.glob("*.pt2") if p.stat().st_size)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    torn = aot.AotFunction(_mix, directory, "test")
    for variant in ("a", "c"):  # one of the two packages is torn: it is rebuilt, the other loads
        torn(variant, lambda: TOKENS, x, weight, torch.ones(5) if variant == "c" else None,
             2.0 if variant == "c" else 0.5, variant == "a")
    assert len(torn.built) == 1
    assert torch.allclose(torn("a", lambda: TOKENS, x, weight, None, 0.5, True)[0], want, atol=1e-6)


def test_a_loaded_package_leaves_no_copy_in_the_temp_folder(built, tmp_path, monkeypatch):
    """torch's loader unpacks the package under the temp folder and removes that copy
    only when destroyed (a killed replica never is); it is removed once loaded."""
    directory, _, weight = built
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    loaded = aot.AotFunction(_mix, directory, "test")
    x = torch.randn(3, 4)
    got = loaded("a", lambda: TOKENS, x, weight, None, 0.5, True)
    assert loaded.built == {} and [p.name for p in tmp_path.iterdir()] == [f"v41-aot-load-{os.getuid()}.lock"]
    assert torch.allclose(got[0], _mix(x, weight, None, 0.5, True)[0], atol=1e-6)
    x = torch.randn(9, 4)  # and it keeps running without the copy
    assert torch.allclose(loaded("a", lambda: TOKENS, x, weight, None, 0.5, True)[0],
                          _mix(x, weight, None, 0.5, True)[0], atol=1e-6)


def test_a_new_source_digest_builds_new_packages(built):
    directory, _, weight = built
    changed = aot.AotFunction(_mix, directory, "changed")
    changed("a", lambda: TOKENS, torch.randn(2, 4), weight, None, 0.5, True)
    assert len(changed.built) == 1


def test_a_weight_kept_transposed_is_read_as_kept_by_a_package_of_its_own(built):
    """A weight is built for its strides (model.runtime.weight_layout keeps the engine's
    input-major) and passed as it is; the same values row-major are another package."""
    directory, _, weight = built
    function = aot.AotFunction(_mix, directory, "strides")
    kept = weight.t().contiguous().t()  # [5, 4], stored [4, 5]
    assert not kept.is_contiguous() and torch.equal(kept, weight)
    for n in (1, 6):
        x = torch.randn(n, 4)
        got = function("t", lambda: TOKENS, x, kept, None, 0.5, True)
        assert torch.allclose(got[0], _mix(x, weight, None, 0.5, True)[0], atol=1e-6)
    assert dict(function._variants["t"][1])[1] is False  # not copied on each call
    function("r", lambda: TOKENS, torch.randn(2, 4), weight, None, 0.5, True)
    assert len(function.built) == 2
