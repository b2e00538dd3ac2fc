"""The SSD store's crash loop (bench/ssd_crash.py) at CI size: a batched, striped, journaled store killed at random
points loses nothing acknowledged and serves nothing corrupt (the bench runs 200+ kills for the figures)."""

from bench.ssd_crash import crash_loop


def test_a_store_killed_mid_batch_loses_no_acknowledged_block_and_serves_no_corrupt_one(tmp_path):
    res = crash_loop(str(tmp_path), kills=15, seed=1)
    assert res["durable_lost"] == 0 and res["corrupt_served"] == 0
    assert res["blocks_acknowledged"] >= 15 and res["blocks_recovered"] > 0
