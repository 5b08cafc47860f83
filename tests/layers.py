"""The suite's layers, as markers: every test is ``unit``, ``integration`` or ``e2e``.

- ``unit``: in this process, on CPU, no server and no child process (files the test
  only reads, such as the golden checkpoint, are fine);
- ``integration``: real Redis servers, Ray actors, child processes, compilers, or
  files that are the subject of the test (the SSD tier, checkpoints on disk);
- ``e2e``: the whole app over HTTP, or a CLI command end to end.

A module names its layer in ``pytestmark``; a test of another layer in that module
names its own, and the closest mark wins: :func:`resolve_layers` moves a module's mark
down onto those of its tests that name none, so that ``-m unit`` selects exactly the
tests whose layer is unit. A test without a layer fails the collection, and so does
a module filed in a layer's folder (``tests/unit/...``) whose mark names another.

In one process (``-n 0``) the run order is by layer (unit, then integration, then
e2e: the fast feedback first), each module's tests kept together (module fixtures are
set up once), in file order otherwise; the modules whose apps share the session's
Serve runtime (tests/serve_harness.py) run last, one after another, so that it starts
once. With workers (pytest-xdist, the default: ``-n auto``) the same units go to the
workers longest first (:func:`order`).

Loaded by tests/conftest.py as a plugin (``pytest_plugins``).
"""

from __future__ import annotations

import pytest

LAYERS = ("unit", "integration", "e2e")
SHARED_RUNTIME = "serve_runtime"  # the session fixture of tests/conftest.py
SHARING = pytest.StashKey[set]()  # config.stash: the modules with a test using it


def layer_of(node: pytest.Item | pytest.Module) -> str | None:
    """The closest layer mark of ``node`` (its own, else its class's, else its module's)."""
    return next((mark.name for mark in node.iter_markers() if mark.name in LAYERS), None)


def resolve_layers(items: list[pytest.Item]) -> None:
    """Give each test exactly one layer mark: its own if it names one, else its module's
    (taken off the module, where ``-m`` would see it on every test of the module)."""
    modules = {item.getparent(pytest.Module) for item in items}
    inherited = {}
    for module in modules:
        names = [mark.name for mark in module.own_markers if mark.name in LAYERS]
        if len(names) > 1:
            raise pytest.UsageError(f"{module.nodeid}: more than one layer mark ({names})")
        inherited[module] = names[0] if names else None
        module.own_markers[:] = [mark for mark in module.own_markers if mark.name not in LAYERS]
    for item in items:
        if layer_of(item) is None and inherited[item.getparent(pytest.Module)] is not None:
            item.add_marker(inherited[item.getparent(pytest.Module)])
        if layer_of(item) is None:
            raise pytest.UsageError(f"{item.nodeid}: no layer mark (pytestmark = pytest.mark.unit, "
                                    "integration or e2e; see tests/layers.py)")


def check_folders(items: list[pytest.Item]) -> None:
    """A module in a layer's folder (tests/unit, tests/integration, tests/e2e) is of that layer."""
    for module, layer in module_layers(items).items():
        folder = module.path.parent.name
        if folder in LAYERS and folder != layer:
            raise pytest.UsageError(f"{module.nodeid}: its tests are mostly {layer}, but it is filed under {folder}")


def module_layers(items: list[pytest.Item]) -> dict[pytest.Module, str]:
    """Each module's layer: that of most of its tests (the folder it belongs in)."""
    counts: dict[pytest.Module, dict[str, int]] = {}
    for item in items:
        tally = counts.setdefault(item.getparent(pytest.Module), dict.fromkeys(LAYERS, 0))
        tally[layer_of(item)] += 1
    return {module: max(LAYERS, key=tally.__getitem__) for module, tally in counts.items()}


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unit modules first, then integration, then e2e, then the modules using the Serve
    runtime (noted in ``config.stash[SHARING]``); a module's tests together, in file
    order otherwise.

    Under pytest-xdist (``-n``), each module is one unit of work (its module fixtures
    set up once), and so are the modules sharing the Serve runtime, together; the
    longest units start first and the quick ones fill in behind them: the shared
    runtime's, then the modules with ``slow`` tests (e2e, integration, unit), then
    the rest."""
    layers = module_layers(items)
    first: dict[pytest.Module, int] = {}
    sharing, heavy = set(), set()
    for index, item in enumerate(items):
        module = item.getparent(pytest.Module)
        first.setdefault(module, index)
        if SHARED_RUNTIME in item.fixturenames:
            sharing.add(module)
        if item.get_closest_marker("slow") is not None:
            heavy.add(module)

    def rank(item: pytest.Item) -> tuple[int, int, int]:
        module = item.getparent(pytest.Module)
        if parallel(config):
            layer = len(LAYERS) - LAYERS.index(layers[module])
            return 0 if module in sharing else 1 if module in heavy else 2, layer, first[module]
        return len(LAYERS) if module in sharing else LAYERS.index(layers[module]), 0, first[module]

    items.sort(key=rank)
    config.stash[SHARING] = sharing
    for item in items:
        module = item.getparent(pytest.Module)
        item.add_marker(pytest.mark.xdist_group(SHARED_RUNTIME if module in sharing else module.nodeid))


def parallel(config: pytest.Config) -> bool:
    """Whether this is a pytest-xdist worker (``-n N``, N > 0)."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    resolve_layers(items)
    if not any("::" in arg for arg in config.args):  # (a test named by its id: part of its module)
        check_folders(items)
    order(config, items)
