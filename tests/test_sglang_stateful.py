"""Stateful test of the SGLang backend: requests (finished, running, aborted), device flushes and evictions, host
evictions, in any order. Invariants: every prefix handed to a request holds exactly the KV its tokens produced
(checked at each admission), and once everything is released and the device tree flushed, the allocator's free
count is back to its start and nothing is locked or in flight."""

import itertools

import pytest

pytest.importorskip("sglang")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402

from kvtier.tier.executor import DeferredExecutor, FailingExecutor  # noqa: E402
from tests import sglang_helpers as h  # noqa: E402

BASES = [list(range(1000 * b + 1, 1000 * b + 17)) for b in range(2)]  # 16 tokens each
NAMESPACES = [None, "lora-a"]  # ns_tag = index


class BackendMachine(RuleBasedStateMachine):
    executor = staticmethod(lambda: None)  # the tier's default (copies complete at once on the CPU)
    page_size, tokens_per_block = 4, None  # host blocks of one page

    def __init__(self):
        super().__init__()
        # 64 device slots; 8 host blocks of 4 tokens (512 B each), so the host evicts too
        self.s = h.build(kv_size=64, page_size=self.page_size, host_blocks_kb=4, max_reqs=8,
                         executor=self.executor(), tokens_per_block=self.tokens_per_block)
        self.free0 = self.s.allocator.available_size()
        self.running = []

    def _tokens(self, base, n, suffix):
        return BASES[base][:n] + [5000 + t for t in suffix]

    def _admit_and_forward(self, tokens, ns):
        return h.admit_checked(self.s, tokens, extra_key=NAMESPACES[ns], ns_tag=ns)[0]

    @rule(base=st.integers(0, 1), n=st.integers(1, 16), suffix=st.lists(st.integers(0, 3), max_size=4),
          ns=st.integers(0, 1), flush_first=st.booleans())
    def finished_request(self, base, n, suffix, ns, flush_first):
        if flush_first:  # makes host hits common
            h.flush_device(self.s)
        req = self._admit_and_forward(self._tokens(base, n, suffix), ns)
        if req is not None:
            h.release(self.s, req)

    @precondition(lambda self: len(self.running) < 2)
    @rule(base=st.integers(0, 1), n=st.integers(1, 16), ns=st.integers(0, 1))
    def start_request(self, base, n, ns):
        req = self._admit_and_forward(self._tokens(base, n, []), ns)
        if req is not None:
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(abort=st.booleans())
    def end_request(self, abort):
        req = self.running.pop(0)
        if abort:
            self.s.cache.release_aborted_request(req.cache_request_handle)
        h.release(self.s, req, checkpoint=not abort)

    @rule()
    def flush_device(self):
        h.flush_device(self.s)

    @rule(n=st.integers(1, 24))
    def evict_device(self, n):
        self.s.cache.evict(EvictParams(num_tokens=n))

    @rule(n=st.integers(1, 4))
    def evict_host(self, n):
        self.s.cache.tier.evict(n)

    @invariant()
    def accounting(self):
        s = self.s
        held = s.cache.total_size()
        assert s.cache.evictable_size() + s.cache.protected_size() == held
        assert s.allocator.available_size() <= self.free0

    def teardown(self):
        while self.running:
            h.release(self.s, self.running.pop())
        s = self.s
        s.cache.wait_all()
        assert s.cache.num_inflight == 0 and s.cache.protected_size() == 0
        h.flush_device(s)
        assert s.cache.total_size() == 0
        assert s.allocator.available_size() == self.free0, "slot leak"


BackendMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=16, deadline=None,
                                            suppress_health_check=list(HealthCheck))
test_backend_stateful = BackendMachine.TestCase


_SEEDS = itertools.count()


class FailingBackendMachine(BackendMachine):
    """The same requests with copies in flight (released when the scheduler waits) and a fifth of them failing
    while being issued: a failed load is recomputed, a failed store is not cached, nothing leaks."""

    executor = staticmethod(lambda: FailingExecutor(DeferredExecutor(), 0.2, next(_SEEDS)))


FailingBackendMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None,
                                                   suppress_health_check=list(HealthCheck))
test_backend_stateful_with_failing_copies = FailingBackendMachine.TestCase


class PageOneBackendMachine(FailingBackendMachine):
    """An engine at page size 1 with host blocks of 4 tokens: host hits are whole blocks, device prefixes end
    anywhere (loads start mid-block), copies in flight and a fifth failing."""

    page_size, tokens_per_block = 1, 4


PageOneBackendMachine.TestCase.settings = FailingBackendMachine.TestCase.settings
test_backend_stateful_page_1_with_blocks_of_4 = PageOneBackendMachine.TestCase
