"""Probe: ``bench/bench_remote.py`` (cells ``layer_first,page_first``, no hit, 5 repetitions) with one change to the
remote tier, to see where the put's gap to raw goes: ``base`` (none), ``nohash`` (no payload checksum: every
header says 0, so gets still match), ``batchN`` (``remote_tier.BATCH_BYTES`` of N MiB, the raw client's calls too).

Run: ``VARIANT=nohash python bench/probes/remote_variants.py OUT.json`` (one process per variant, about 2 minutes
each on 2 cores); ``--merge OUT.json A.json B.json ...`` writes the variants' summaries side by side.
"""

import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def merge(out: str, paths: list[str]) -> None:
    rows = {}
    for p in paths:
        d = json.load(open(p))
        rows[os.path.splitext(os.path.basename(p))[0]] = {
            k: v for k, v in d["summary"].items() if ":" not in k and isinstance(v, float)}
    with open(out, "w") as f:
        json.dump({"variants": rows}, f, indent=1)


def main() -> None:
    if sys.argv[1] == "--merge":
        merge(sys.argv[2], sys.argv[3:])
        return
    from kvtier.tier import remote_tier

    variant = os.environ.get("VARIANT", "base")
    if variant == "nohash":
        remote_tier._checksum = lambda rows: 0
    elif variant.startswith("batch"):
        remote_tier.BATCH_BYTES = int(variant[5:]) << 20
    sys.argv = ["bench_remote.py", "--cells", "layer_first,page_first", "--hit-tokens", "0", "--reps", "5",
                "--no-plot", "--out", sys.argv[1]]
    runpy.run_path(os.path.join(ROOT, "bench", "bench_remote.py"), run_name="__main__")


if __name__ == "__main__":
    main()
