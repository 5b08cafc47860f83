"""Functions of tensors built ahead of time by AOTInductor, kept on disk.

A ``torch.compile``d function pays ~35-90 us of Python on every call before its
kernels run (dynamo's guards, the AOT autograd wrapper, the generated Python that
allocates the outputs); a decode step on a small model makes 40 such calls, so that
overhead, not the kernels, is most of the compiled step. AOTInductor compiles the same
inductor kernels with a C++ wrapper into a shared library (a ``.pt2`` package): a call
hands the tensors to that wrapper and its kernels run, with no guards and no Python in
between. The caller keys each call by variant (below); the inputs that vary between
calls are made contiguous and their fixed sizes compared with the package's (see
:meth:`AotFunction._prepare`), so that a call that does not fit raises instead of
reading past a buffer. (The package's own input checks, ``AOTI_RUNTIME_CHECK_INPUTS``,
stay off: they also compare the stride of a dimension of size 1, which the export
fixes from its example, and so refuse contiguous inputs.)

An :class:`AotFunction` wraps one Python function. It is called with a *variant* key
(which the caller knows: a layer and an MoE form) and the function's arguments; the
first call of a variant exports the function with its non-tensor arguments baked in
and the named dimensions dynamic (``torch.export``), builds or loads the package, and
every later call of that variant runs it. Variants with the same signature (the layers
of a model share most) share one package. Packages live under ``cache_dir`` named by
a digest of everything that determines their code: the sources of the modules the
functions call, torch's version, the CPU's vector instruction set, the function, its
non-tensor arguments and its tensors' static shapes and dtypes. A package is written
to a temporary name and renamed into place, so a reader sees all of one or none; one
that fails to load is built again. Builds take a lock per package, so processes starting
together (the replicas of a pool) build each package once. Each build logs a line
(``model.runtime.aot``): `v41 serve` shows them as a first start's progress.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import logging
import os
import shutil
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree

log = logging.getLogger(__name__)  # a line per package built: a first start's progress


def default_cache_dir() -> Path:
    """``$V41_AOT_CACHE``, else ``$XDG_CACHE_HOME/v41/aot`` (``~/.cache/v41/aot``)."""
    if os.environ.get("V41_AOT_CACHE"):
        return Path(os.environ["V41_AOT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "v41" / "aot"


def compiler_problem() -> str | None:
    """Why no package can be built on this host (no working C++ compiler), or None."""
    from torch._inductor import config, cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        names = [name for name in (config.cpp.cxx if isinstance(config.cpp.cxx, tuple) else (config.cpp.cxx,)) if name]
        return f"no working C++ compiler ({', '.join(names)} --version failed; set CXX to one)"
    return None


@dataclass(frozen=True)
class Dynamic:
    """A dynamic dimension: its name, its range, and a multiple (a dimension that is
    ``multiple`` times the named one, e.g. pooling groups of ``ratio`` rows)."""

    name: str
    low: int
    high: int
    multiple: int = 1


# One variant's dynamic dimensions: per argument index, per dimension.
Dims = dict[int, dict[int, Dynamic]]
# A prepared variant: its package, its tensors' places (and whether each is made
# contiguous), and the (place, axis, size) each call is checked against
# (AotFunction._prepare).
_Variant = tuple[Callable, tuple[tuple[int, bool], ...], tuple[tuple[int, int | None, int], ...]]


def _example_size(dim: Dynamic) -> int:
    """An example value inside the range that export does not specialise: 0 and 1 are
    special to its shape analysis, so 2 or more where the range allows."""
    return min(dim.high, max(dim.low, 3))


def _example(tensor: torch.Tensor, dims: dict[int, Dynamic]) -> torch.Tensor:
    """``tensor`` with each dynamic dimension resized to its example size (rows repeated
    or dropped; the values do not matter to the code built), contiguous; one without
    (a weight) as it is, strides and all."""
    if not dims:
        return tensor
    for axis, dim in dims.items():
        size = _example_size(dim) * dim.multiple
        if tensor.shape[axis] >= size:
            tensor = tensor.narrow(axis, 0, size)
        else:
            shape = [-1] * tensor.dim()
            shape[axis] = size
            tensor = tensor.narrow(axis, 0, 1).expand(*shape)
    return tensor.contiguous()  # (an activation is built and called contiguous)


class _Bound(torch.nn.Module):
    """``fn`` with its non-tensor arguments fixed: forward takes the tensors (and Nones)."""

    def __init__(self, fn: Callable, args: Sequence, tensor_places: list[int]) -> None:
        super().__init__()
        self.fn, self.args, self.places = fn, list(args), tensor_places

    def forward(self, *tensors):
        args = list(self.args)
        for place, tensor in zip(self.places, tensors):
            args[place] = tensor
        return self.fn(*args)


class _Package:
    """A loaded package, called with the tensors (without the Nones: export flattens
    them away) and without the per-call parsing of its input and output specs that
    ``AOTICompiledModel.__call__`` does."""

    def __init__(self, path: Path) -> None:
        with warnings.catch_warnings():  # torch's own spec parsing warns of its deprecations
            warnings.simplefilter("ignore", FutureWarning)
            self.loader = _load(path)
            self.out_spec = pytree.treespec_loads(self.loader.get_call_spec()[1])
            # (a flat tuple, what most functions return, is rebuilt without the tree walk)
            self.flat = self.out_spec.type is tuple and all(self.out_spec.child(i).is_leaf()
                                                             for i in range(self.out_spec.num_children))

    def __call__(self, tensors: list[torch.Tensor]):
        outputs = self.loader.boxed_run(tensors)
        return tuple(outputs) if self.flat else pytree.tree_unflatten(outputs, self.out_spec)


def _unpack_root() -> Path:
    """Where torch's package loader unpacks a package: C++'s ``temp_directory_path()``."""
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        if os.environ.get(name):
            return Path(os.environ[name])
    return Path("/tmp")


def _load(path: Path):
    """The package's loader, without the copy of the package it unpacked.

    The loader unpacks the package into ``aotinductor_XXXXXX`` under the temp folder,
    loads its library from there and removes it only when the loader is destroyed,
    which a killed process (a Serve replica at shutdown, a Ray actor) never does: each
    start left ~2 MB per package behind. Once loaded nothing reads the copy again (the
    library stays mapped), so it is removed here. Loads take a lock in that folder, so
    a new folder holding this package's contents is this load's and no other v41
    process's; one that failed to load is removed too.
    """
    root = _unpack_root()
    with zipfile.ZipFile(path) as package:  # a torn package raises here: a miss
        inner = package.namelist()[0].split("/")[0]
    try:
        lock = open(root / f"v41-aot-load-{os.getuid()}.lock", "a")  # noqa: SIM115 (one per user: /tmp is shared)
    except OSError:  # no lock, no cleanup: the copy stays, as torch leaves it
        return torch._inductor.aoti_load_package(str(path)).loader
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = set(root.glob("aotinductor_*"))
        try:
            return torch._inductor.aoti_load_package(str(path)).loader
        finally:
            for unpacked in set(root.glob("aotinductor_*")) - before:
                if (unpacked / inner).is_dir():
                    shutil.rmtree(unpacked, ignore_errors=True)


class AotFunction:
    """``fn`` built by AOTInductor per variant (see the module docstring)."""

    def __init__(self, fn: Callable, cache_dir: Path, source_digest: str) -> None:
        self.fn, self.cache_dir, self.source_digest = fn, cache_dir, source_digest
        self._variants: dict[object, _Variant] = {}
        self._runners: dict[Path, Callable] = {}  # one loaded package per signature
        self.built: dict[Path, float] = {}  # the packages this process built: seconds each took

    @property
    def packages(self) -> frozenset[Path]:
        """The packages this process has loaded or built."""
        return frozenset(self._runners)

    def __call__(self, variant: object, dims: Callable[[], Dims], *args):
        """Run ``fn(*args)``; ``dims`` gives the variant's dynamic dimensions on its first call."""
        found = self._variants.get(variant)
        if found is None:
            found = self._variants[variant] = self._prepare(args, dims())
        runner, inputs, fixed = found
        for place, axis, size in fixed:
            if (args[place].dim() if axis is None else args[place].shape[axis]) != size:
                what = "rank" if axis is None else f"size {axis}:"
                raise ValueError(f"{self.fn.__name__} ({variant!r}): argument {place} has shape "
                                 f"{tuple(args[place].shape)}; its package takes {what} {size}")
        return runner([args[place].contiguous() if copy else args[place] for place, copy in inputs])

    def _prepare(self, args: Sequence, dims: Dims) -> _Variant:
        """The variant's package, the places of its tensors in ``args`` (its Nones are
        not passed) and whether each is made contiguous on each call, and the sizes
        checked on each call. The
        package's kernels assume the strides they were built for (another layout gives
        wrong sums, not an error), so every input with a dynamic dimension (an
        activation) is built and called contiguous, and has its rank and its other sizes
        checked: (place, axis, size), axis None for the rank. Any other input is a weight,
        the same tensor on every call of the variant: built for its strides, which are
        part of the package's signature (an input-major weight,
        :mod:`model.runtime.weight_layout`, is read as it is kept), and passed as it is."""
        places = [i for i, a in enumerate(args) if a is None or isinstance(a, torch.Tensor)]
        copy = frozenset(i for i in places if args[i] is not None and i in dims)
        fixed = tuple((i, axis, size) for i in places if i in dims and args[i] is not None
                      for axis, size in [(None, args[i].dim()), *enumerate(args[i].shape)] if axis not in dims[i])
        statics = [None if i in places else args[i] for i in range(len(args))]
        signature = repr((
            self.source_digest, torch.__version__, str(torch._inductor.cpu_vec_isa.pick_vec_isa()),
            self.fn.__module__, self.fn.__qualname__, statics,
            [None if args[i] is None else (str(args[i].dtype), str(args[i].device),
                                           [dims.get(i, {}).get(axis) or size
                                            for axis, size in enumerate(args[i].shape)],
                                           None if i in dims else args[i].stride())
             for i in places]))
        digest = hashlib.sha256(signature.encode()).hexdigest()[:24]
        path = self.cache_dir / f"{self.fn.__name__.strip('_')}-{digest}.pt2"
        runner = self._runners.get(path)
        if runner is None:
            runner = self._runners[path] = self._load_or_build(path, args, dims, places)
        return runner, tuple((i, i in copy) for i in places if args[i] is not None), fixed

    def _load_or_build(self, path: Path, args: Sequence, dims: Dims, places: list[int]) -> Callable:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # One build per package: another process building it now (a second replica
        # starting beside this one) is waited for, and its package loaded.
        with os.fdopen(os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                try:
                    return _Package(path)
                except Exception:  # noqa: BLE001 (a torn or foreign package is a miss: built again below)
                    path.unlink(missing_ok=True)
            return self._build(path, args, dims, places)

    def _build(self, path: Path, args: Sequence, dims: Dims, places: list[int]) -> Callable:
        log.info("building %s (%d built so far by this process)", path.name, len(self.built))
        started = time.perf_counter()
        examples = tuple(None if args[i] is None else _example(args[i], dims.get(i, {})) for i in places)
        symbols: dict[str, torch.export.Dim] = {}

        def symbol(dim: Dynamic):
            if dim.name not in symbols:
                symbols[dim.name] = torch.export.Dim(dim.name, min=dim.low, max=dim.high)
            return symbols[dim.name] * dim.multiple if dim.multiple != 1 else symbols[dim.name]

        shapes = tuple(None if args[i] is None else
                       {axis: symbol(dim) for axis, dim in dims.get(i, {}).items() if dim.low != dim.high}
                       for i in places)
        bound = _Bound(self.fn, args, places)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".partial.pt2")
        os.close(handle)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                program = torch.export.export(bound, examples, dynamic_shapes=(shapes,), strict=False)
                torch._inductor.aoti_compile_and_package(program, package_path=partial)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        self.built[path] = time.perf_counter() - started
        log.info("built %s in %.1f s", path.name, self.built[path])
        return _Package(path)


def source_digest(modules: Sequence[object]) -> str:
    """A digest of the modules' sources: a change to any formula builds new packages."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:16]
