"""DeepSeek V4.1-Flash in plain PyTorch: the network, its inference engine, training.

No Ray and no network here. File I/O is the checkpoint's (``loader.py``); caches are
explicit objects the engine owns and passes in (``cache.py``, ``serialize.py`` for
their bytes), never buffers hidden inside modules.
"""
