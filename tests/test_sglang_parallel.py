"""The SGLang backend under parallel topologies, with real rank processes over gloo and sglang's real pools,
allocator and requests (:mod:`tests.tp_ranks`): pipeline parallelism (PP=2, TP=2 x PP=2), DP attention (two DP
ranks, each its own attention-TP group) and MLA under TP=2.

Each topology runs a hypothesis state machine (finished, running and aborted requests, flushes, evictions, each
rank's copies completing at its own moments, and in the failing variants a fifth of the copies failing per rank)
and a fixed scheduler sequence. Invariants after every step: every rank of one DP rank (its attention-TP ranks and
pipeline stages) holds the same device tree (sizes, locks, evicted flags), host index, allocator count and tracked
copies; every prefix handed to a request holds exactly the KV its tokens produced on that rank's layers; at the end
nothing is in flight or locked and every device slot and host block is back. The stages run each operation one
after the other, first stage first, so a protocol that made an earlier stage wait for a later one would hang here.
"""

import os

import pytest

pytest.importorskip("sglang")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule  # noqa: E402

from tests.tp_ranks import RankError, Ranks, Topology  # noqa: E402

PP2 = Topology(tp=1, pp=2, layers=(2, 3))  # stage 1 holds more layers: fewer host blocks fit its 4 KiB
TP2_PP2 = Topology(tp=2, pp=2)
DP2 = Topology(tp=1, dp=2)
DP2_TP2 = Topology(tp=2, dp=2)
MLA_TP2 = Topology(tp=2, mla=True, layers=(3,))  # 3 layers: the ranks' store shares differ in size
RANKS = {}  # topology -> its rank processes (started once, reused by every test of the topology)
STEPS_RUN = {}  # machine -> steps run, KV checks and host loads made


def ranks(topo: Topology) -> Ranks:
    if topo not in RANKS:
        RANKS[topo] = Ranks(topo=topo)
    return RANKS[topo]


@pytest.fixture(scope="module", autouse=True)
def _close_ranks():
    yield
    for r in RANKS.values():
        r.close()
    print(f"parallel state machines: {STEPS_RUN}")


def same_within_dp(topo: Topology, digests: list) -> None:
    """Every rank of one DP rank (all its attention-TP ranks and stages) holds what its first rank holds."""
    for rank, d in enumerate(digests):
        stage, dp, _ = topo.coords(rank)
        first = dp * topo.tp
        assert d == digests[first], (f"rank {rank} (stage {stage}, DP rank {dp}) diverged from rank {first}:\n"
                                     f"{d}\n{digests[first]}")


def assert_clean(ends: list) -> None:
    for rank, e in enumerate(ends):
        counts = ("host_pages", "kv_checks", "host_loads", "repairs", "lower_reads", "pages_read")
        leaks = {k: v for k, v in e.items() if k not in counts and v}
        assert not leaks and e["host_pages"] == 0, f"rank {rank} leaked: {e}"


# --- fixed scheduler sequences ---

@pytest.mark.parametrize("topo", [PP2, TP2_PP2], ids=["pp2", "tp2xpp2"])
def test_a_later_stage_follows_the_first_stages_verdicts_and_waits_for_its_own_copies(topo):
    """The first stage completes a store before the second stage's copy: the second stage finalizes the same copy
    in the same round (waiting for its own), never earlier and never later; the loaded prefix is exact on every
    stage's layers; the match issues no collective and no message."""
    R = ranks(topo)
    R.call("new", 0.0, 0)
    w = topo.world
    lines = R.call("describe_ranks")
    want = f"pp_rank 1; pipeline stage 1 of 2 (layers from 2); agrees with {w - 1} other rank(s) ({topo.tp} per stage)"
    assert want in lines[-1], lines
    R.call("finished_request", 0, 16, [], 0, False)  # its store is in flight everywhere
    R.call("round")  # nothing completed anywhere: nothing released
    d = R.call("digest")
    same_within_dp(topo, d)
    assert d[0][2] == 1  # the store is still tracked
    first = tuple(3 if topo.coords(r)[0] == 0 else 0 for r in range(w))
    R.call("complete", first)  # done on the first stage only
    R.call("round")  # the first stage decides: released on every stage
    d = R.call("digest")
    same_within_dp(topo, d)
    assert d[0][2] == 0 and d[0][0][-1] == 4  # nothing tracked; 4 host pages on every rank
    R.call("flush_device")
    assert R.call("collectives_in_match", 0, 16, 0) == [[16, 0]] * w  # a host hit, no collective or message
    R.call("finished_request", 0, 16, [1, 2], 0, False)  # loads the 16 host tokens on every stage, checks the KV
    same_within_dp(topo, R.call("digest"))
    ends = R.call("teardown")
    assert_clean(ends)
    assert all(e["host_loads"] == 1 and e["kv_checks"] == 1 for e in ends)


def test_a_copy_failed_on_a_later_stage_only_is_issued_again():
    """A stage after the first cannot make the first stage drop a copy, so a copy that failed there alone is issued
    again, synchronously (stage 1's injected failures are transient here); the stages stay alike and the KV exact."""
    R = ranks(PP2)
    R.call("new", 0.3, 7)  # each stage fails 30% of its copies; stage 1's go through when issued again
    for i in range(12):
        R.call("finished_request", i % 2, 16, [i % 4], i % 2, i % 3 == 0)
        R.call("complete", (4, 4))
        R.call("round")
        same_within_dp(PP2, R.call("digest"))
    ends = R.call("teardown")
    assert_clean(ends)
    assert ends[0]["repairs"] == 0 and ends[1]["repairs"] > 0  # only a later stage repairs
    assert ends[1]["kv_checks"] > 0


def test_a_copy_failing_again_on_a_later_stage_raises_a_clear_error():
    """When the copy issued again fails too, the later stage raises instead of holding KV it never copied."""
    R = ranks(PP2)
    R.call("new", (0.0, 1.0), 3, True)  # stage 1 fails every copy, every time it is issued
    R.call("finished_request", 0, 16, [], 0, False)
    R.call("complete", (3, 3))
    with pytest.raises(RankError, match="store failed on pipeline stage 1 and again when issued a second time"):
        R.call("round")  # stage 0 completed the store: stage 1 must hold it too


def test_mla_ranks_hold_one_copy_of_each_page_and_split_its_stores():
    """MLA under TP=2: the latent is the same on both ranks, so they map one host pool (one segment, one inode)
    holding the blocks of both ranks' 4 KiB, each rank's stores copy its share of the layers (1 of 3 and 2 of 3),
    and each rank loads all layers from it: exact KV on both. Host bytes per page held, both ranks together: one
    block (a pool per rank would hold a block on each)."""
    R = ranks(MLA_TP2)
    R.call("new", 0.0, 0)
    mem = R.call("pool_memory")
    assert all(m["shared"] for m in mem) and mem[0]["inode"] == mem[1]["inode"]  # one memory, mapped twice
    assert [m["store_layers"] for m in mem] == [[0, 1], [1, 3]]
    assert R.call("describe_ranks")[1].endswith("host pool shared by the stage's 2 ranks, stores copy layers 1..2")
    block = mem[0]["block_bytes"]
    assert mem[0]["num_blocks"] == 2 * (4096 // block)  # both ranks' host memory, in one pool
    host_bytes_per_page = mem[0]["nbytes"] / mem[0]["num_blocks"]  # one segment for both ranks
    print(f"MLA TP=2, host bytes per page held, both ranks together: {host_bytes_per_page:.0f} shared, "
          f"{2 * block} with a pool per rank")
    assert host_bytes_per_page == block
    R.call("finished_request", 0, 16, [], 0, False)  # 4 blocks stored: each rank copies its layers only
    R.call("complete", (3, 0))
    R.call("round")
    assert R.call("digest")[0][0][-1] == 0  # rank 1's share is still in flight: not in the index anywhere
    R.call("complete", (0, 3))
    R.call("round")
    stored = [m["bytes_stored"] for m in R.call("pool_memory")]
    assert stored == [4 * mem[0]["block_bytes"] // 3, 4 * mem[0]["block_bytes"] * 2 // 3]
    R.call("flush_device")
    R.call("finished_request", 0, 16, [1], 0, False)  # every rank loads all 3 layers of the 4 blocks: checked
    ends = R.call("teardown")
    assert_clean(ends)
    assert all(e["host_loads"] == 1 and e["kv_checks"] == 1 for e in ends)


def test_a_later_stages_ranks_sharing_a_pool_finalize_a_copy_once_all_have_completed_it():
    """A later pipeline stage finalizes on the first stage's verdict. With one host pool shared by the stage's MLA
    ranks, a rank that finalized a store after its own layer share alone could evict the device pages and load the
    host page back while the other rank's share was still being copied: its layers were read unwritten."""
    topo = Topology(tp=2, pp=2, mla=True, layers=(2,))
    R = ranks(topo)
    R.call("new", 0.0, 0)
    assert all(m["shared"] for m in R.call("pool_memory"))
    R.call("finished_request", 0, 16, [], 0, False)  # its store is in flight everywhere
    R.call("complete", tuple(3 if topo.coords(r)[0] == 0 else 0 for r in range(topo.world)))  # the first stage's
    R.call("slow_verdicts", 3, 3.0)  # rank 3 (stage 1) finalizes 3 s late
    # one call: evict the device pages (the round's agreement finalizes the store), then load the host page back
    # and check every layer's KV on every rank
    R.call("steps", [("evict_device", (10**9,)), ("finished_request", (0, 16, [1], 0, False))])
    ends = R.call("teardown")
    assert_clean(ends)
    assert all(e["host_loads"] == 1 and e["kv_checks"] == 1 for e in ends)


@pytest.mark.parametrize("tp,pp,mla", [(1, 2, False), (2, 1, True)], ids=["pp2", "mla-tp2"])
def test_ranks_running_concurrently_with_skewed_copies_keep_identical_trees(tmp_path, tp, pp, mla):
    """The scheduler sequence of tests/test_sglang_gpu.py on the CPU: two rank processes running at once (not one
    stage after the other), the last rank's copies completing a round later; identical trees after every round,
    the same pages loaded with exact KV, nothing leaked; MLA ranks map one pool."""
    import json

    import torch.multiprocessing as mp

    from tests import sglang_helpers as h

    mp.spawn(h.tp_skew_worker, args=(2, str(tmp_path / "pg"), str(tmp_path), "cpu", 4, tp, pp, mla), nprocs=2,
             join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["digests"] == r1["digests"]
    # the first round: TP ranks keep the store locked until the late rank completes; a later stage waits for its own
    # copy of what the first stage (done) decided
    assert (r0["digests"][0][2] > 0) == (pp == 1)
    assert (r0["host_hit"], r0["loaded"]) == (r1["host_hit"], r1["loaded"]) == (12, 12)
    assert r0["kv_ok"] and r1["kv_ok"] and r0["no_leak"] and r1["no_leak"]
    assert (r0["shared_inode"] is not None) == mla and r0["shared_inode"] == r1["shared_inode"]


def test_mla_stages_share_their_host_pools_all_or_none(tmp_path):
    """TP=2 x PP=2 with MLA pools, the second stage unable to create its shared segment: had the first stage shared
    its pool (twice the blocks a rank's own holds) while the second kept one per rank, the start-up check of equal
    block counts across the cache would have stopped the server; no stage shares, and the ranks serve as usual."""
    import json

    import torch.multiprocessing as mp

    from tests import sglang_helpers as h

    mp.spawn(h.tp_skew_worker, args=(4, str(tmp_path / "pg"), str(tmp_path), "cpu", 4, 2, 2, True, 1), nprocs=4,
             join=True)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert not [o["error"] for o in out if "error" in o]
    assert all(o["shared_inode"] is None for o in out)
    assert all(o["kv_ok"] and o["no_leak"] for o in out)


# --- state machines ---

class ParallelMachine(RuleBasedStateMachine):
    """Requests, flushes, evictions and per-rank completions on every rank of ``topo``; DP ranks run requests of
    their own (a request rule picks the DP rank it runs on)."""

    topo = PP2
    fail_rate = 0.0
    ssd = False  # an SSD tier below each rank's host pool

    def __init__(self):
        super().__init__()
        self.R = ranks(self.topo)
        self.running = [0] * self.topo.dp

    @initialize(seed=st.integers(0, 2**20))
    def new_ranks(self, seed):
        self.R.call("new", self.fail_rate, 2 * seed, False, self.ssd)

    def _step(self, op, *args):
        self.R.call(op, *args)
        self._count("steps", 1)
        same_within_dp(self.topo, self.R.call("digest"))

    def _dp(self, data):
        return data.draw(st.integers(0, self.topo.dp - 1)) if self.topo.dp > 1 else None

    @rule(data=st.data(), base=st.integers(0, 1), n=st.integers(1, 16),
          suffix=st.lists(st.integers(0, 3), max_size=4), ns=st.integers(0, 1), flush_first=st.booleans())
    def finished_request(self, data, base, n, suffix, ns, flush_first):
        self._step("on_dp", self._dp(data), "finished_request", base, n, suffix, ns, flush_first)

    @precondition(lambda self: min(self.running) < 2)
    @rule(data=st.data(), base=st.integers(0, 1), n=st.integers(1, 16), ns=st.integers(0, 1))
    def start_request(self, data, base, n, ns):
        dp = self._dp(data)
        self._step("on_dp", dp, "start_request", base, n, ns)
        d = self.R.call("digest")
        for k in range(self.topo.dp):
            self.running[k] = d[k * self.topo.tp][3]

    @precondition(lambda self: max(self.running) > 0)
    @rule(data=st.data(), abort=st.booleans())
    def end_request(self, data, abort):
        dps = [k for k in range(self.topo.dp) if self.running[k] > 0]
        dp = data.draw(st.sampled_from(dps))
        self._step("on_dp", dp if self.topo.dp > 1 else None, "end_request", abort)
        self.running[dp] -= 1

    @rule(data=st.data())
    def copies_complete(self, data):
        per_rank = tuple(data.draw(st.integers(0, 3)) for _ in range(self.topo.world))
        self._step("complete", per_rank)

    @rule()
    def scheduling_round(self):
        self._step("round")

    @rule(data=st.data())
    def flush_device(self, data):
        self._step("on_dp", self._dp(data), "flush_device")

    @rule(data=st.data(), n=st.integers(1, 24))
    def evict_device(self, data, n):
        self._step("on_dp", self._dp(data), "evict_device", n)

    @rule(data=st.data(), n=st.integers(1, 4))
    def evict_host(self, data, n):
        self._step("on_dp", self._dp(data), "evict_host", n)

    @precondition(lambda self: self.ssd)
    @rule(data=st.data())
    def ssd_delay(self, data):
        self._step("ssd_delay", tuple(data.draw(st.sampled_from([0.0, 0.002, 0.02])) for _ in range(self.topo.world)))

    def _count(self, key: str, n: int) -> None:
        mine = STEPS_RUN.setdefault(type(self).__name__, {"steps": 0, "kv_checks": 0, "host_loads": 0,
                                                          "lower_reads": 0})
        mine[key] += n

    def teardown(self):
        ends = self.R.call("teardown")
        self._count("kv_checks", sum(e["kv_checks"] for e in ends))
        self._count("host_loads", sum(e["host_loads"] for e in ends))
        self._count("lower_reads", sum(e["lower_reads"] for e in ends))
        assert_clean(ends)


STEPS = int(os.environ.get("KVTIER_PARALLEL_STEPS", "300"))  # per machine
STEPS_PER_EXAMPLE = 30  # short examples, many of them (the first one hypothesis tries is its simplest)


def _machine(name: str, topo: Topology, fail_rate: float, ssd: bool = False, steps: int = STEPS):
    machine = type(name, (ParallelMachine,), {"topo": topo, "fail_rate": fail_rate, "ssd": ssd})
    machine.TestCase.settings = settings(max_examples=max(2, steps // STEPS_PER_EXAMPLE),
                                         stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
                                         suppress_health_check=list(HealthCheck))
    return machine


PP2Machine = _machine("PP2Machine", PP2, 0.0)
FailingPP2Machine = _machine("FailingPP2Machine", PP2, 0.2)
TP2xPP2Machine = _machine("TP2xPP2Machine", TP2_PP2, 0.2)
DP2Machine = _machine("DP2Machine", DP2, 0.0)
DP2xTP2Machine = _machine("DP2xTP2Machine", DP2_TP2, 0.2)
MLATP2Machine = _machine("MLATP2Machine", MLA_TP2, 0.2)
SsdMLATP2Machine = _machine("SsdMLATP2Machine", MLA_TP2, 0.2, ssd=True, steps=STEPS // 2)  # a pool per rank

test_pp2_stateful_with_skewed_completions = PP2Machine.TestCase
test_pp2_stateful_with_skewed_and_failing_copies = FailingPP2Machine.TestCase
test_tp2_x_pp2_stateful_with_skewed_and_failing_copies = TP2xPP2Machine.TestCase
test_dp_attention_ranks_agree_only_within_their_group = DP2Machine.TestCase
test_dp2_x_tp2_stateful_with_skewed_and_failing_copies = DP2xTP2Machine.TestCase
test_mla_tp2_shared_pool_stateful_with_skewed_and_failing_copies = MLATP2Machine.TestCase
test_mla_tp2_stateful_with_an_ssd_tier = SsdMLATP2Machine.TestCase
