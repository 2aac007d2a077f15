"""freeze_startup_heap: what start-up built, taken out of the garbage collector's scans.

Never imports trio or torch.
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_startup_heap() -> bool:
    """``gc.collect()`` then ``gc.freeze()``, the first time it is called in this process
    (later calls do nothing); returns whether it froze now. Every engine calls it once it
    is up, as vLLM's engine core does.

    An engine step allocates short-lived objects per stream per step, and the full
    collections they trigger would otherwise rescan everything start-up built (torch,
    transformers, the tokenizer, the engine: hundreds of thousands of objects), a
    quarter of a second each and about half the control plane's time at 256 streams
    (``benchmarks/control_plane.py --unfreeze-gc`` shows it). Frozen objects are skipped
    by the cycle collector only: reference counting still frees them, and the collection
    just before leaves no cyclic garbage among them. What is frozen and later becomes
    cyclic garbage stays (at most the first engine's own objects, once it is closed).
    Once per process, so a restarting server or a test suite does not pay a full
    collection per engine.
    """
    global _frozen
    if _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    return True
