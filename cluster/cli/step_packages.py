"""The compiled step's packages, made ready before `v41 serve` starts the app.

A replica that runs the compiled step loads one AOTInductor package per function
signature from the disk cache, or builds it (model/runtime/aot.py): minutes on a host's
first start for a model and code, silent inside Ray's replicas. `v41 serve` therefore
builds or loads them here first, the way its replicas will (the decoder's engine and
drafter, the prefill encoder), with a line per package built; the replicas then load
them in seconds. Where they cannot be built (no C++ compiler, a failed build) it says
so and serves the eager step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class _Progress(logging.Handler):
    """Each package built, as a line: the first one under a heading saying what it is."""

    def __init__(self, say: Callable[[str], None], cache_dir) -> None:
        super().__init__(logging.INFO)
        self.say, self.cache_dir, self.building = say, cache_dir, False

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("building") and not self.building:
            self.building = True
            self.say(f"v41: building the compiled step's packages into {self.cache_dir} (the first start of "
                     "this model and code here: ~3 min on 2 cores; later starts load them in seconds)")
        elif message.startswith("built"):
            self.say(f"v41:   {message}")


def _say(line: str) -> None:
    print(line, flush=True)


def decoder_step(app_args: dict) -> str:
    """The step the decoder pool runs with ``app_args`` (as :func:`ready_compiled_step` left them)."""
    from actors.config import AppConfig

    config = AppConfig.from_args(app_args)
    return "compiled step" if config.compiles(config.decoder_parallel) else "eager step"


def ready_compiled_step(app_args: dict, say: Callable[[str], None] = _say,
                        stopping: Callable[[], bool] = lambda: False) -> dict:
    """``app_args`` with ``compiled_step`` decided for this host: False where a pool
    would run it but its packages cannot be built here (said why), else as given, the
    packages built or loaded (said how many, and how long it took). A build that fails
    once ``stopping()`` is true was stopped (a signal's exception raised inside torch's
    export can come out as another one): that exception goes on, no eager fallback."""
    from actors.config import AppConfig
    from actors.replica import ModelBundle
    from model.runtime import aot

    config = AppConfig.from_args(app_args)
    pools = [drop_decoder for drop_decoder, parallel in ((False, config.decoder_parallel),
                                                          (True, config.prefill_parallel))
             if config.compiles(parallel)]
    if not pools:
        return app_args
    if (problem := aot.compiler_problem()) is not None:
        say(f"v41: {problem}: serving the eager step (decoding ~2-3x slower)")
        return {**app_args, "compiled_step": False}
    started = time.perf_counter()
    progress = _Progress(say, aot.default_cache_dir())
    logger = logging.getLogger(aot.__name__)
    logger.addHandler(progress)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        functions = []
        for drop_decoder in pools:
            bundle = ModelBundle(config, drop_decoder)
            if bundle.drafter is not None and config.speculation != "off":
                from model.runtime.speculative import SpeculativeDrafter

                SpeculativeDrafter(bundle.drafter, bundle.engine, None).warm_compiled()
            functions += bundle.engine.compiled.functions.values()
    except Exception as error:  # noqa: BLE001 (whatever stops the build, the server runs eager)
        if stopping():
            raise
        say(f"v41: the compiled step could not be built here ({type(error).__name__}: {error}): "
            "serving the eager step (decoding ~2-3x slower)")
        return {**app_args, "compiled_step": False}
    finally:
        logger.removeHandler(progress)
        logger.setLevel(level)
    packages = frozenset().union(*(function.packages for function in functions))
    built = frozenset().union(*(function.built for function in functions))
    say(f"v41: compiled step ready in {time.perf_counter() - started:.1f} s "
        f"({len(built)} packages built, {len(packages - built)} loaded from {aot.default_cache_dir()})")
    return app_args
