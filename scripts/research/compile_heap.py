"""Heap that XLA needs to compile one decode step, by allocating function (Linux, memray).

    pip install memray
    python scripts/research/compile_heap.py smollm2-135m-instruct turbo4 8000 [--top 8]
    XLA_FLAGS=--xla_cpu_use_fusion_emitters=true python scripts/research/compile_heap.py ...

Loads the model, allocates a cache of CONTEXT + 50 slots, lowers `decode_step` and tracks every
native allocation while it compiles (memray, aggregated). Prints one JSON line: the heap's
peak during the compile (MB) and, at that peak, the bytes held under the first XLA function
of each allocation's stack (the largest `--top`). tqjax sets XLA_FLAGS when imported
(`tqjax.xla`); a flag given in the environment wins.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import re
import tempfile

from program_memory import decode_args, model_and_cache, parser  # (scripts/research)

from tqjax.decode.generate import decode_step


def main() -> None:
    import memray

    p = parser(__doc__)
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args()
    m, cache = model_and_cache(a)
    lowered = decode_step.lower(*decode_args(m, cache, a.context))
    gc.collect()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "compile.bin")
        with memray.Tracker(path, native_traces=True,
                            file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS):
            lowered.compile()
        reader = memray.FileReader(path)
        held: collections.Counter = collections.Counter()
        for rec in reader.get_high_watermark_allocation_records(merge_threads=True):
            frames = [f for f, _, _ in rec.native_stack_trace()]
            name = next((re.sub(r"\(.*", "", f) for f in frames if "xla::" in f), "other")
            held[name] += rec.size
        peak = reader.metadata.peak_memory
    print(json.dumps({"model": a.model, "kv": a.kv, "context": a.context,
                      "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "compile_heap_peak_mb": round(peak / 1e6, 1),
                      "held_at_peak_mb": {k: round(v / 1e6, 1)
                                          for k, v in held.most_common(a.top)}}))


if __name__ == "__main__":
    main()
