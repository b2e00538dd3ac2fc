"""Stateful test of the SGLang backend under TP: two real rank processes over gloo run the same requests (finished,
running, aborted), flushes and evictions, while each rank's copies complete at its own moments (the test releases
them per rank) and, in the failing variant, fail on one rank and not the other. Invariants, after every step: the
ranks hold identical device trees (sizes, locks, evicted flags), host indexes, allocator counts and tracked copies;
every prefix handed to a request holds exactly the KV its tokens produced (checked on each rank at admission); at the
end, nothing is in flight or locked, and every device slot and host block is back where it started."""

import os

import pytest

pytest.importorskip("sglang")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule  # noqa: E402

from tests.tp_ranks import Ranks  # noqa: E402

RANKS = Ranks(world=2)
STEPS_RUN = {}  # machine -> steps run, and KV checks made on each rank


@pytest.fixture(scope="module", autouse=True)
def _ranks():
    yield
    RANKS.close()
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


class TPBackendMachine(RuleBasedStateMachine):
    fail_rate = 0.0

    def __init__(self):
        super().__init__()
        self.running = 0

    @initialize(seed=st.integers(0, 2**20))
    def new_ranks(self, seed):
        RANKS.call("new", self.fail_rate, 2 * seed)  # each rank adds its rank: the ranks fail different copies
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
        mine = STEPS_RUN.setdefault(type(self).__name__, {"steps": 0, "kv_checks": 0, "host_loads": 0})
        mine[key] += n

    def teardown(self):
        ends = RANKS.call("teardown")
        self._count("kv_checks", ends[0]["kv_checks"])
        self._count("host_loads", ends[0]["host_loads"])
        for rank, e in enumerate(ends):
            leaks = {k: v for k, v in e.items() if k not in ("host_pages", "kv_checks", "host_loads") and v}
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
