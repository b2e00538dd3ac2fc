"""Stateful test of the SGLang backend under TP: two real rank processes over gloo run the same requests (finished,
running, aborted), flushes and evictions, while each rank's copies complete at its own moments (the test releases
them per rank) and, in the failing variant, fail on one rank and not the other. Invariants, after every step: the
ranks hold identical device trees (sizes, locks, evicted flags), host indexes, allocator counts and tracked copies;
every prefix handed to a request holds exactly the KV its tokens produced (checked on each rank at admission); at the
end, nothing is in flight or locked, and every device slot and host block is back where it started."""

import os
import tempfile

import pytest

pytest.importorskip("sglang")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule  # noqa: E402

from tests.mooncake_master import Master  # noqa: E402
from tests.tp_ranks import Ranks  # noqa: E402

RANKS = Ranks(world=2)
STEPS_RUN = {}  # machine -> steps run, and KV checks made on each rank


MASTERS: list = []  # the module's Mooncake master, started by the first test that needs it


def shared_master() -> Master:
    """One Mooncake master on loopback for the module's remote tests (each example's keys are its own)."""
    if not MASTERS:
        MASTERS.append(Master(tempfile.mkdtemp(prefix="kvtier_tp_master_")))
    return MASTERS[0]


@pytest.fixture(scope="module", autouse=True)
def _ranks():
    yield
    RANKS.close()
    for m in MASTERS:
        m.kill()
    print(f"TP state machines: {STEPS_RUN}")


def test_match_prefix_issues_no_collective_under_tp():
    """With TP, match_prefix used to all-reduce its host hit: one blocking collective per request matched (up to
    128 a scheduling round). The host indexes are identical on every rank (agreed in flush_pending_backups), so
    the match needs none: a host hit is found with zero collectives on both ranks."""
    RANKS.call("new", 0.0, 0)
    RANKS.call("finished_request", 0, 16, [], 0, False)
    RANKS.call("flush_device")  # the prefix is on the host only
    assert RANKS.call("collectives_in_match", 0, 16, 0) == [[16, 0], [16, 0]]  # every page, no collective
    ends = RANKS.call("teardown")
    assert all(e["slots_leaked"] == 0 and e["inflight"] == 0 for e in ends)


def test_a_block_on_one_ranks_ssd_only_is_read_by_no_rank_until_every_rank_holds_it():
    """Rank 1's SSD write lands late: a request matched meanwhile finds the prefix on rank 0's SSD only, and no rank
    reads it (the MIN of the offers; a read on rank 0 alone would fork the host indexes). Once every rank holds
    it, the next request's read is agreed, runs on both, and the request after that loads the prefix's KV (checked
    on each rank) from the CPU tier."""
    import time

    RANKS.call("new", 0.0, 0, False, True)
    RANKS.call("ssd_delay", (0.0, 1.0))
    RANKS.call("finished_request", 0, 16, [], 0, False)
    RANKS.call("complete", (4, 4))
    RANKS.call("round")  # the stores enter the host index; the SSD writes start
    RANKS.call("flush_device")
    RANKS.call("evict_host", 16)  # the prefix is below the CPU tier only (where its write has landed)
    time.sleep(0.2)  # rank 0's write has landed, rank 1's has not
    RANKS.call("finished_request", 0, 16, [], 0, False)
    d = RANKS.call("digest")
    assert d[0] == d[1] and d[0][-1] == 0, d  # no read on either rank
    ends = RANKS.call("ssd_read_counts")
    assert ends == [[0, 0], [0, 0]], ends  # (reads, pages read)
    RANKS.call("ssd_delay", (0.0, 0.0))
    RANKS.call("wait_ssd_writes")
    RANKS.call("flush_device")
    RANKS.call("evict_host", 16)
    RANKS.call("finished_request", 0, 16, [], 0, False)  # offered by both: read on both
    d = RANKS.call("digest")
    assert d[0] == d[1] and d[0][-1] == 1, d
    RANKS.call("wait_reads")
    RANKS.call("round")  # the read's blocks enter both host indexes
    RANKS.call("flush_device")
    RANKS.call("start_request", 0, 16, 0)  # a host hit, loaded and checked on each rank
    d = RANKS.call("digest")
    assert d[0] == d[1], d
    assert [c[1] for c in RANKS.call("ssd_read_counts")] == [4, 4]
    RANKS.call("end_request", False)
    ends = RANKS.call("teardown")
    assert all(e["host_loads"] == 1 and e["slots_leaked"] == 0 and e["host_blocks_leaked"] == 0 for e in ends), ends


def test_a_prefix_in_one_ranks_remote_store_only_is_fetched_by_no_rank_until_every_rank_holds_it():
    """Rank 1's puts land late: a request matched meanwhile starts a probe on both ranks (a probe's plan asks for
    every block past the CPU hit); rank 0's finds the prefix, rank 1's does not, and the ranks agree on fetching
    the MIN, none, before either gives it a CPU block. Once both hold it, the count agreed is the whole prefix,
    the gets run on both, and the next request loads the fetched KV (checked on each rank)."""
    import time

    RANKS.call("new", 0.0, 101, False, False, shared_master().addr)
    RANKS.call("ssd_delay", (0.0, 1.0))
    RANKS.call("finished_request", 0, 16, [], 0, False)
    RANKS.call("complete", (4, 4))
    RANKS.call("round")  # the stores enter the host index; the puts start
    RANKS.call("flush_device")
    RANKS.call("evict_host", 16)
    time.sleep(0.2)  # rank 0's puts have landed, rank 1's have not
    RANKS.call("finished_request", 0, 16, [], 0, False)  # the probes start on both ranks
    RANKS.call("wait_reads")  # both probes returned: 4 blocks on rank 0, none on rank 1
    RANKS.call("round")
    d = RANKS.call("digest")
    assert d[0] == d[1] and d[0][-1] == 0, d  # agreed on none: ended unread on both
    assert RANKS.call("ssd_read_counts") == [[2, 0], [2, 0]]  # the first request's probe found nothing either
    RANKS.call("ssd_delay", (0.0, 0.0))
    RANKS.call("complete", (4, 4))
    RANKS.call("round")
    RANKS.call("wait_ssd_writes")  # every put has landed
    RANKS.call("flush_device")
    RANKS.call("evict_host", 16)
    RANKS.call("finished_request", 0, 16, [], 0, False)
    RANKS.call("wait_reads")
    RANKS.call("round")  # the count: 4 on both; the gets start
    RANKS.call("wait_reads")
    RANKS.call("round")  # the gets ended on both: their blocks enter both host indexes
    d = RANKS.call("digest")
    assert d[0] == d[1] and d[0][-1] == 0, d
    assert [c[1] for c in RANKS.call("ssd_read_counts")] == [4, 4]
    RANKS.call("complete", (4, 4))
    RANKS.call("round")
    RANKS.call("flush_device")
    RANKS.call("start_request", 0, 16, 0)  # a host hit, loaded and checked on each rank
    assert RANKS.call("digest")[0] == RANKS.call("digest")[1]
    RANKS.call("end_request", False)
    ends = RANKS.call("teardown")
    assert all(e["host_loads"] == 1 and e["slots_leaked"] == 0 and e["host_blocks_leaked"] == 0 for e in ends), ends


class TPBackendMachine(RuleBasedStateMachine):
    fail_rate = 0.0
    ssd = False
    remote = False  # a remote tier on the module's master below each rank's host pool

    def __init__(self):
        super().__init__()
        self.running = 0

    @initialize(seed=st.integers(0, 2**20))
    def new_ranks(self, seed):
        RANKS.call("new", self.fail_rate, 2 * seed, False, self.ssd,  # each rank adds its rank to the seed: the
                   shared_master().addr if self.remote else None)  # ranks fail different copies
    def _step(self, op, *args):
        RANKS.call(op, *args)
        self._count("steps", 1)
        d = RANKS.call("digest")
        assert d[0] == d[1], f"after {op}{args} the ranks diverged:\nrank 0 {d[0]}\nrank 1 {d[1]}"

    @rule(base=st.integers(0, 1), n=st.integers(1, 16), suffix=st.lists(st.integers(0, 3), max_size=4),
          ns=st.integers(0, 1), flush_first=st.booleans())
    def finished_request(self, base, n, suffix, ns, flush_first):
        self._step("finished_request", base, n, suffix, ns, flush_first)

    @precondition(lambda self: self.running < 2)
    @rule(base=st.integers(0, 1), n=st.integers(1, 16), ns=st.integers(0, 1))
    def start_request(self, base, n, ns):
        self._step("start_request", base, n, ns)
        self.running = RANKS.call("digest")[0][3]

    @precondition(lambda self: self.running > 0)
    @rule(abort=st.booleans())
    def end_request(self, abort):
        self._step("end_request", abort)
        self.running -= 1

    @rule(per_rank=st.tuples(st.integers(0, 3), st.integers(0, 3)))
    def copies_complete(self, per_rank):
        self._step("complete", per_rank)

    @rule()
    def scheduling_round(self):
        self._step("round")

    @rule()
    def flush_device(self):
        self._step("flush_device")

    @rule(n=st.integers(1, 24))
    def evict_device(self, n):
        self._step("evict_device", n)

    @rule(n=st.integers(1, 4))
    def evict_host(self, n):
        self._step("evict_host", n)

    def _count(self, key: str, n: int) -> None:
        mine = STEPS_RUN.setdefault(type(self).__name__, {"steps": 0, "kv_checks": 0, "host_loads": 0,
                                                          "lower_reads": 0, "pages_read": 0})
        mine[key] += n

    def teardown(self):
        ends = RANKS.call("teardown")
        self._count("kv_checks", ends[0]["kv_checks"])
        for key in ("host_loads", "lower_reads", "pages_read"):
            self._count(key, ends[0][key])
        for rank, e in enumerate(ends):
            leaks = {k: v for k, v in e.items()
                     if k not in ("host_pages", "kv_checks", "host_loads", "lower_reads", "pages_read") and v}
            assert not leaks and e["host_pages"] == 0, f"rank {rank} leaked: {e}"


STEPS = int(os.environ.get("KVTIER_TP_STEPS", "10000"))  # the failing machine's; the other runs a fifth of it

TPBackendMachine.TestCase.settings = settings(max_examples=max(1, STEPS // 500), stateful_step_count=100,
                                              deadline=None, suppress_health_check=list(HealthCheck))
test_tp_backend_stateful_with_skewed_completions = TPBackendMachine.TestCase


class FailingTPBackendMachine(TPBackendMachine):
    """A fifth of the copies fail while being issued, each rank drawing its own: a copy failed on one rank is
    dropped (store) or recomputed (load) on every rank."""

    fail_rate = 0.2


FailingTPBackendMachine.TestCase.settings = settings(max_examples=max(1, STEPS // 100), stateful_step_count=100,
                                                     deadline=None, suppress_health_check=list(HealthCheck))
test_tp_backend_stateful_with_skewed_and_failing_copies = FailingTPBackendMachine.TestCase


class SsdTPBackendMachine(TPBackendMachine):
    """An SSD tier below each rank's host pool, written through by each rank's own write threads: a block
    evicted from the host is on one rank's SSD and not yet on the other's, reads of it are agreed at the request's
    first match (the MIN of the ranks' offers) and end in the round's agreement (the MIN of what each verified)."""

    ssd = True

    @rule(per_rank=st.tuples(*[st.sampled_from([0.0, 0.002, 0.02])] * 2))
    def ssd_delay(self, per_rank):
        self._step("ssd_delay", per_rank)


SsdTPBackendMachine.TestCase.settings = settings(max_examples=max(1, STEPS // 1000), stateful_step_count=100,
                                                 deadline=None, suppress_health_check=list(HealthCheck))
test_tp_backend_stateful_with_an_ssd_tier = SsdTPBackendMachine.TestCase


class FailingSsdTPBackendMachine(SsdTPBackendMachine):
    """The SSD machine with a fifth of the copies failing, each rank drawing its own."""

    fail_rate = 0.2


FailingSsdTPBackendMachine.TestCase.settings = settings(max_examples=max(1, STEPS // 2500), stateful_step_count=100,
                                                        deadline=None, suppress_health_check=list(HealthCheck))
test_tp_backend_stateful_with_an_ssd_tier_and_failing_copies = FailingSsdTPBackendMachine.TestCase




class RemoteTPBackendMachine(SsdTPBackendMachine):
    """A remote tier (a real Mooncake master) below each rank's host pool instead of the SSD: each rank's puts
    land at their own moments, a fetch's probe starts on every rank and its count is agreed (the MIN of what each
    rank's probe found) before any rank gives it a CPU block; some copies fail."""

    ssd = False
    remote = True
    fail_rate = 0.2


RemoteTPBackendMachine.TestCase.settings = settings(max_examples=max(1, STEPS // 2500), stateful_step_count=100,
                                                    deadline=None, suppress_health_check=list(HealthCheck))
test_tp_backend_stateful_with_a_remote_tier = RemoteTPBackendMachine.TestCase


def test_the_lower_tier_machines_read_from_their_tiers():
    """The SSD and remote machines above did what they are for: reads agreed, run and inserted (run after them)."""
    for kind in ("Ssd", "Remote"):
        runs = [v for k, v in STEPS_RUN.items() if k.startswith(kind) or k.startswith("Failing" + kind)]
        if not runs:
            pytest.skip("run with the lower-tier machines")
        assert sum(v["lower_reads"] for v in runs) > 0 and sum(v["pages_read"] for v in runs) > 0, STEPS_RUN
