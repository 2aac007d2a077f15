"""tune_gc_for_serving: the garbage collector settings an engine's process runs with.

Never imports trio or torch.
"""

from __future__ import annotations

import gc

# The young generation's threshold while engines run (CPython's default is 700).
YOUNG_THRESHOLD = 10_000

_tuned = False


def tune_gc_for_serving() -> bool:
    """The first time it is called in this process: ``gc.collect()``, ``gc.freeze()``,
    and the young generation's threshold raised to at least ``YOUNG_THRESHOLD``. Later
    calls do nothing; returns whether it tuned now. Every engine calls it once it is up
    (and the model worker, in its own process).

    Freezing, as vLLM's engine core does: an engine step allocates short-lived objects
    per stream per step, and the full collections they trigger would otherwise rescan
    everything start-up built (torch, transformers, the tokenizer, the engine: hundreds
    of thousands of objects), a quarter of a second each. Frozen objects are skipped by
    the cycle collector only: reference counting still frees them, and the collection
    just before leaves no cyclic garbage among them. What is frozen and later becomes
    cyclic garbage stays (at most the first engine's own objects, once it is closed).

    The threshold: a young collection starts once tracked objects allocated outnumber
    those freed by more than it. Each step leaves a few outputs per stream alive until
    the streams' consumers take them, about 1,800 objects at 256 streams, so CPython's
    700 made every step run two or three young collections that found nothing to free
    (about a tenth of the control plane's time; ``benchmarks/control_plane.py
    --default-gc`` shows it); at 10,000 steady decode triggers none up to about 1,400
    streams. Cyclic garbage is still collected, after more allocations. A threshold the process had already set higher is kept, and the other
    generations' are left alone.

    Once per process, so a restarting server or a test suite does not pay a full
    collection per engine, and a setting the application makes after the first engine
    started stays.
    """
    global _tuned
    if _tuned:
        return False
    _tuned = True
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if young != 0:  # 0: the application disabled automatic collection; leave it so
        gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    return True
