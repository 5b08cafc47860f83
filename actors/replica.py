"""What every replica of the app loads, and the plumbing the pools' deployments share.

:class:`ModelIdentity` (config, tokenizer, state naming) is what the router and every
replica agree on; :class:`ModelBundle` adds the model, the Engram hasher and an engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import sys
import threading
import time
from pathlib import Path

from actors.config import AppConfig, ParallelConfig
from actors.engine_cpu import keep_to_a_cpu


class ModelIdentity:
    """What the router and every replica agree on: config, tokenizer, state naming."""

    def __init__(self, config: AppConfig):
        from actors.state import StateNaming
        from model.tokenizer import Tokenizer
        from model.config import ModelConfig
        from model.loader import weights_digest
        from model.runtime.serialize import StateIdentity

        self.model_config = ModelConfig.load(config.model)
        text = self.model_config.text
        self.tokenizer = Tokenizer.from_dir(config.model, noise_token_id=text.dspark_noise_token_id)
        identity = StateIdentity.of(text, weights_digest(config.model), self.tokenizer.fingerprint)
        self.naming = StateNaming.of(identity, text, config.chunk_tokens)
        self.eos_ids = text.eos_ids


class ModelBundle(ModelIdentity):
    """What every replica loads besides: the model (whole, or the encoder half), the
    Engram hasher, and an engine."""

    def __init__(self, config: AppConfig, drop_decoder: bool = False):
        import torch

        from actors.pool_model import pool_checkpoint
        from model.loader import load_hasher
        from model.runtime.engine import Engine

        super().__init__(config)
        torch.set_num_threads(config.threads)
        parallel = config.prefill_parallel if drop_decoder else config.decoder_parallel
        self.workers = None  # an expert-parallel replica's other workers (actors/expert_workers.py)
        if parallel.experts > 1:
            from actors.expert_workers import RayExpertWorkers

            self.workers = RayExpertWorkers(config.model, parallel.experts, parallel.worker_resources,
                                            drop_decoder, config.threads)
            checkpoint = self.workers.checkpoint
        else:
            checkpoint = pool_checkpoint(config.model, drop_decoder)
        model, self.drafter = checkpoint.backbone, checkpoint.drafter
        # The vision tower is the prefill pool's: a decoder replica holds none.
        self.vision = checkpoint.vision if drop_decoder else None
        self.hasher = load_hasher(config.model, self.model_config)
        image_token_id = self.model_config.image_token_id if self.model_config.vision is not None else None
        self.engine = Engine(model, self.hasher, bounded_replay=not config.exact_replay,
                             compiled=compiled_here(config, parallel), image_token_id=image_token_id,
                             restore_windows=None if config.exact_replay else config.encoder_replay_windows)
        if self.engine.compiled is not None:
            self.engine.warm_compiled()  # before any step is timed (the DSpark cost table) or served

    def image_encoder(self):
        """The prefill replica's :class:`actors.pool_model.ImageEncoder` (None: no vision tower)."""
        if self.vision is None:
            return None
        from actors.pool_model import ImageEncoder

        return ImageEncoder(self.vision, self.model_config.vision)

    def check_health(self) -> None:
        """Raise when the replica cannot serve: a lost expert worker (Serve then
        replaces the whole replica, its workers with it)."""
        if self.workers is not None and self.workers.link.broken:
            raise RuntimeError(self.workers.link.broken)

    def speculation(self, config: AppConfig):
        """The decoder's :class:`model.runtime.batcher.Speculation`, or None (mode "off", or no
        drafter in the checkpoint). The scheduled mode profiles its step-cost table here,
        for batches of 1, 2, 4, ... up to ``max_batch`` requests."""
        if config.speculation == "off" or self.drafter is None:
            return None
        from model.runtime.batcher import Speculation
        from model.runtime.calibration import Calibration
        from model.runtime.prefix_scheduler import StepCost
        from model.runtime.speculative import SpeculativeDrafter

        path = Path(config.model) / "dspark_calibration.json"
        calibration = Calibration.from_dict(json.loads(path.read_text())) if path.exists() else None
        drafter = SpeculativeDrafter(self.drafter, self.engine, calibration)
        drafter.warm_compiled()  # (a compiled engine: before the cost table times its steps)
        cost = None
        if config.speculation == "scheduled":
            sizes = sorted({min(1 << i, config.max_batch) for i in range(config.max_batch.bit_length() + 1)})
            cost = StepCost.profile(self.engine, drafter, requests=sizes, max_tokens=drafter.block_size + 1)
        k = min(config.speculation_k, drafter.block_size)
        return Speculation(drafter, config.speculation, k=k, cost=cost)

    def store(self, config: AppConfig):
        from actors.store import node_store

        return node_store(config.store_settings(), self.naming.fingerprint.digest)


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def prompt_gil_handoff() -> None:
    """A thread running Python holds the GIL until the interpreter's switch interval
    (5 ms by default) asks it to let go; a replica's event loop, which waits on
    sockets and other threads many times per request, gets it back within 0.5 ms."""
    sys.setswitchinterval(5e-4)


def compiled_here(config: AppConfig, parallel: ParallelConfig) -> bool:
    """Whether a replica of a pool with ``parallel`` runs the compiled step here: unless
    ``compiled_step`` is False or the pool's experts are split over workers (their MoE
    runs in other processes: eager), and where this host has a C++ compiler to build
    the packages with (else eager, saying why in the replica's log)."""
    if not config.compiles(parallel):
        return False
    from model.runtime.aot import compiler_problem

    if (problem := compiler_problem()) is not None:
        logging.getLogger(__name__).warning("compiled step: %s; this replica runs the eager step", problem)
        return False
    return True


class EngineThread(concurrent.futures.ThreadPoolExecutor):
    """The one thread all of a replica's model work runs on (the engine is not
    thread-safe), off the event loop; :attr:`waiting` counts the jobs queued behind the
    one running, so that a run of decode steps can stop for an admission or a cancel.
    ``pin``: the thread keeps to a CPU of its own (:mod:`actors.engine_cpu`)."""

    def __init__(self, pin: bool = False):
        super().__init__(max_workers=1, thread_name_prefix="engine", initializer=keep_to_a_cpu if pin else None)
        self._lock = threading.Lock()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        with self._lock:
            self._waiting += 1

        def started() -> None:
            with self._lock:
                self._waiting -= 1

        def run():
            started()
            return fn(*args, **kwargs)

        future = super().submit(run)
        future.add_done_callback(lambda done: started() if done.cancelled() else None)  # (never ran)
        return future


def one_thread_executor(pin: bool = False) -> EngineThread:
    prompt_gil_handoff()
    return EngineThread(pin)


def engram_rows(engram, metrics):
    """The engine's ``engram_rows`` callable for a lookup the router started when the
    prompt arrived (None without one): the answers are dequantised as they arrive,
    off the engine thread, and awaited only right before the first Engram layer."""
    if engram is None:
        return None
    engram.prepare()

    def rows():
        start = time.perf_counter()
        try:
            return engram.rows()
        finally:
            metrics.engram_wait.observe(time.perf_counter() - start)

    return rows


def prefilled(handoff, arrived: float, where: str, metrics):
    """Mark a handoff as prefilled ``where`` ("pool" | "decoder"), arrived at
    ``arrived`` and done now, and count its prefill time."""
    handoff.timeline.update(prefill_in=arrived, prefill_out=time.time())
    handoff.prefilled_by = where
    metrics.prefill.observe(handoff.prefill_s)
    return handoff
