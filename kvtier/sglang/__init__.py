"""kvtier for SGLang: the ``kvtier`` radix-cache backend (``--radix-cache-backend kvtier``).

This is the only kvtier package that imports SGLang, and it does so lazily: importing ``kvtier.sglang`` itself needs
nothing beyond kvtier. Pieces:

* :func:`register`: the ``sglang.srt.plugins`` entry point. Every SGLang process calls it through ``load_plugins()``;
  it calls ``register_radix_cache_backend("kvtier", factory)``. Idempotent. On an unsupported SGLang version it logs
  a warning and registers nothing (an engine plugin must not break a server that does not use it); selecting the
  backend then fails with SGLang's "not registered" error, and :func:`factory` itself raises a clear error.
* :func:`factory`: ``TreeCacheBuildContext -> KVTierRadixCache``. Reads the kvtier config from ``$KVTIER_CONFIG``
  (defaults when unset, with ``page_size`` taken from the engine) and rejects setups the backend does not support.
* :class:`kvtier.sglang.radix_cache.KVTierRadixCache`: the cache (import it from that module).
"""

from __future__ import annotations

import dataclasses
import logging
import os

SUPPORTED_SGLANG_VERSION = "0.5.23"
ENV_VAR = "KVTIER_CONFIG"  # kvtier.config.ENV_VAR (kept here so that importing this package needs nothing)
BACKEND_NAME = "kvtier"
MIN_HOST_SHARE_BYTES = 1 << 20  # a rank's share of host memory below this holds no host pool worth pinning

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_SGLANG_VERSION", "BACKEND_NAME", "installed_sglang_version", "check_sglang_version",
           "register", "factory", "unsupported_reasons", "model_identity", "metrics_labels", "rank_agreement",
           "per_rank_ssd_dirs"]


def installed_sglang_version() -> str | None:
    """The installed ``sglang`` distribution's version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version() -> str:
    """Return the installed SGLang version; raise a clear error unless it is the supported one.

    Raises:
        ImportError: SGLang is not installed.
        RuntimeError: another SGLang version is installed.
    """
    version = installed_sglang_version()
    if version is None:
        raise ImportError(f"kvtier's SGLang backend needs sglang=={SUPPORTED_SGLANG_VERSION}, which is not installed "
                          f"(pip install 'kvtier[sglang]')")
    if version != SUPPORTED_SGLANG_VERSION:
        raise RuntimeError(f"kvtier's SGLang backend supports sglang=={SUPPORTED_SGLANG_VERSION} only; "
                           f"sglang {version} is installed (the RadixCache API changes between releases). Install "
                           f"sglang=={SUPPORTED_SGLANG_VERSION} or drop --radix-cache-backend {BACKEND_NAME}.")
    return version


def register() -> bool:
    """Register the ``kvtier`` radix-cache backend with SGLang (the ``sglang.srt.plugins`` entry point).

    Returns:
        True if the backend is registered after the call (now or by an earlier call), False if SGLang's version is
        unsupported (a warning is logged instead of raising, so servers that do not select kvtier keep working).
    """
    try:
        check_sglang_version()
    except (ImportError, RuntimeError) as e:
        logger.warning("kvtier: not registering the %r radix-cache backend: %s", BACKEND_NAME, e)
        return False
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    try:
        register_radix_cache_backend(BACKEND_NAME, factory)
    except ValueError:  # already registered (load_plugins or an import ran twice)
        if get_radix_cache_factory(BACKEND_NAME) is not factory:
            logger.warning("kvtier: another factory is already registered as %r; leaving it", BACKEND_NAME)
    return True


def unsupported_reasons(ctx) -> list[str]:
    """Why the ``TreeCacheBuildContext`` ``ctx`` describes a setup this backend does not support (empty: supported)."""
    params = ctx.params
    reasons = []
    if ctx.disable_radix_cache:
        reasons.append("--disable-radix-cache is set (drop --radix-cache-backend kvtier, or enable the radix cache)")
    if ctx.is_hybrid_swa:
        reasons.append("hybrid sliding-window (SWA) models need UnifiedRadixCache; kvtier caches full attention only")
    if ctx.is_hybrid_ssm:
        reasons.append("hybrid SSM/Mamba models need UnifiedRadixCache; kvtier caches full attention only")
    if getattr(ctx, "is_dsa", False):
        reasons.append("DSA (sparse-attention) models are not supported")
    if ctx.enable_hierarchical_cache:
        reasons.append("--enable-hierarchical-cache (HiCache) cannot be combined with kvtier: kvtier is the host tier")
    if getattr(params, "is_eagle", False):
        reasons.append("EAGLE speculative decoding (bigram radix keys) is not supported yet")
    draft = _draft_with_own_kv(ctx.server_args)
    if draft is not None:
        reasons.append(f"--speculative-algorithm {draft}: its draft model keeps its own KV pool, which kvtier does "
                       "not fill, so a loaded prefix leaves the draft's KV stale (NGRAM, with no draft model, runs)")
    if getattr(params, "enable_session_radix_cache", False):
        reasons.append("--enable-session-radix-cache needs UnifiedRadixCache")
    if (getattr(ctx.server_args, "dcp_size", 1) or 1) > 1:
        reasons.append("--dcp-size > 1 (decode context parallelism) hands out slot ids that are not rows of this "
                       "rank's KV pool (each rank keeps every dcp_size-th token)")
    if getattr(ctx.server_args, "enable_cp_decode_attn_tp", False):
        reasons.append("--enable-cp-decode-attn-tp splits a context-parallel rank's heads at decode time; kvtier "
                       "needs every CP rank to hold the full KV of its heads (as SGLang's CP prefill leaves it)")
    mode = getattr(ctx.server_args, "disaggregation_mode", "null") if ctx.server_args is not None else "null"
    if mode not in (None, "null"):
        reasons.append(f"prefill/decode disaggregation (--disaggregation-mode {mode}) is not supported yet: the "
                       "prefill server's early send of cached prefixes does not see kvtier's in-flight loads")
    return reasons


def _draft_with_own_kv(server_args) -> str | None:
    """The name of the speculative algorithm in ``server_args`` whose draft model keeps a KV pool of its own (None
    when there is none, or when it is an EAGLE-family one, which ``params.is_eagle`` reports)."""
    name = getattr(server_args, "speculative_algorithm", None)
    if not name:
        return None
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string(name)
    if algo.is_none() or algo.is_ngram() or algo.is_eagle():
        return None
    return str(name).upper()


def _config_for(params):
    """The kvtier config: ``$KVTIER_CONFIG`` when set (its page_size must match the engine's), else defaults with
    the engine's page size."""
    from kvtier.config import TierConfig

    if os.environ.get(ENV_VAR, "").strip():
        config = TierConfig.from_env()
        if config.page_size != params.page_size:
            raise ValueError(f"kvtier config ${ENV_VAR}={os.environ[ENV_VAR]} has page_size {config.page_size} but "
                             f"SGLang runs with --page-size {params.page_size}: set page_size: {params.page_size} in "
                             f"the kvtier config")
        return config
    return dataclasses.replace(TierConfig(), page_size=params.page_size)


def factory(ctx):
    """Build a :class:`~kvtier.sglang.radix_cache.KVTierRadixCache` from SGLang's ``TreeCacheBuildContext``.

    Raises:
        RuntimeError / ImportError: the installed SGLang is not the supported version.
        ValueError: an unsupported setup (the message lists every reason) or a bad kvtier config.
    """
    check_sglang_version()
    reasons = unsupported_reasons(ctx)
    if reasons:
        raise ValueError(f"--radix-cache-backend {BACKEND_NAME}: unsupported setup:\n  - " + "\n  - ".join(reasons))
    from kvtier.sglang.radix_cache import KVTierRadixCache

    params = ctx.params
    config = _config_for(params)
    ranks = _ranks_text(ctx)
    if config.ssd_cache_gb > 0 and getattr(params, "pp_size", 1) > 1:
        raise ValueError(f"--radix-cache-backend {BACKEND_NAME}: the SSD tier (ssd_cache_gb > 0) does not run with "
                         f"pipeline stages yet ({ranks}); set ssd_cache_gb: 0 or run one stage (TP alone is fine)")
    if config.remote_backend is not None and getattr(params, "pp_size", 1) > 1:
        raise ValueError(f"--radix-cache-backend {BACKEND_NAME}: the remote tier (remote_backend) does not run with "
                         f"pipeline stages yet ({ranks}); set remote_backend: null or run one stage (TP alone is "
                         "fine)")
    config = per_rank_ssd_dirs(config, ctx)
    budget = host_budget(config.cpu_cache_bytes)
    if budget is not None and budget < MIN_HOST_SHARE_BYTES:
        raise ValueError(f"--radix-cache-backend {BACKEND_NAME}: this rank's share of host memory for a host pool is "
                         f"{budget / (1 << 30):.2f} GiB by SGLang's rule (what is available, less its 10 GiB reserve, "
                         "shared by the host's ranks): free host memory or run fewer ranks on this host")
    if budget is not None and config.cpu_cache_bytes > budget and "cpu_cache_gb" not in config.given_keys:
        # no size configured: the default pool shrinks to this rank's share (a size the config gives that does
        # not fit is an error instead, raised when the pool is built)
        gb = budget / (1 << 30)
        logger.info("kvtier: default host pool of %.1f GiB per rank exceeds this rank's share of host memory; "
                    "using %.2f GiB (set cpu_cache_gb in $%s to choose)", config.cpu_cache_gb, gb, ENV_VAR)
        config = dataclasses.replace(config, cpu_cache_gb=gb)
    note = prefetch_gate_note(config, ctx.server_args)
    if note is not None:
        logger.log(note[0], "kvtier: %s", note[1])
    forward_stream = None
    try:
        forward_stream = ctx.tp_worker.model_runner.forward_stream
    except AttributeError:
        pass
    return KVTierRadixCache(params, config, agreement=rank_agreement(ctx), forward_stream=forward_stream,
                            host_budget_bytes=budget, model_identity=model_identity(ctx),
                            metrics_labels=metrics_labels(ctx))


def per_rank_ssd_dirs(config, ctx):
    """``config`` with each TP rank's SSD directories: ``tp<rank>`` under each configured one when the server runs
    several TP ranks (one store per directory; every rank reads the same config)."""
    if config.ssd_cache_gb <= 0 or ctx.tp_size <= 1:
        return config
    dirs = ";".join(os.path.join(d, f"tp{ctx.tp_rank}") for d in config.ssd_dirs)
    logger.info("kvtier: TP rank %d keeps its SSD blocks in %s", ctx.tp_rank, dirs)
    return dataclasses.replace(config, ssd_cache_dir=dirs)


def prefetch_gate_note(config, server_args) -> tuple[int, str] | None:
    """The start-up log line on the prefetch policy (level, text), when a lower tier is on: SGLang 0.5.23 holds a
    waiting request back for its read only under ``--enable-lmcache`` (:mod:`kvtier.sglang.prefetch`)."""
    if config.ssd_cache_gb <= 0 and config.remote_backend is None:
        return None
    policy = config.prefetch_policy
    if policy == "best_effort":
        return logging.INFO, "prefetch_policy best_effort: a request never waits for its SSD or remote read"
    if getattr(server_args, "enable_lmcache", False):
        return logging.INFO, (f"prefetch_policy {policy}: a waiting request is held back for its SSD or remote read "
                              "(SGLang's prefetch gate, on with --enable-lmcache; LMCache is not imported)")
    return logging.WARNING, (f"prefetch_policy {policy} acts as best_effort: SGLang 0.5.23 holds a waiting request "
                             "back for its read only with --enable-lmcache (kvtier answers that gate; LMCache is not "
                             "imported). Add --enable-lmcache, or set prefetch_policy: best_effort to silence this")


def _ranks_text(ctx) -> str:
    """The server's ranks besides this one, in words (empty for a one-rank server)."""
    parts = [f"--{name}-size {size}" for name, size in (("tp", ctx.tp_size),
                                                        ("pp", getattr(ctx.params, "pp_size", 1))) if size > 1]
    return ", ".join(parts)


def _world(group) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def rank_agreement(ctx):
    """The :class:`~kvtier.sglang.agreement.RankAgreement` of this rank's cache, from SGLang's cache groups: within
    a stage the attention-CP and attention-TP groups when either has several ranks (with DP attention the TP group
    of this DP rank only), else the TP group; across stages the PP group (SGLang's HiCache agrees over the same)."""
    from kvtier.sglang.agreement import RankAgreement

    params = ctx.params
    attn = [g for g in (params.attn_cp_cache_group, params.attn_tp_cache_group) if _world(g) > 1]
    tp_group = params.tp_cache_group
    if tp_group is None and ctx.tp_size > 1 and ctx.tp_group is not None:
        tp_group = getattr(ctx.tp_group, "cpu_group", None)
    return RankAgreement(attn or [tp_group], pp_group=params.pp_cache_group if params.pp_size > 1 else None,
                         pp_rank=params.pp_rank, pp_size=params.pp_size)


def metrics_labels(ctx) -> dict:
    """kvtier's metric labels, as SGLang labels its own: the served model name and the TP rank."""
    args = ctx.server_args
    name = getattr(args, "served_model_name", None) or getattr(args, "model_path", None) or ""
    return {"model_name": str(name), "tp_rank": str(ctx.tp_rank), "pp_rank": str(getattr(ctx.params, "pp_rank", 0))}


def model_identity(ctx) -> dict:
    """What this rank's KV belongs to, as the SSD and remote tiers' blocks record it: the model and tokenizer, their
    revision, quantization and KV dtype, and the TP and PP layout (another value of any of them never reads the
    blocks; a pipeline stage holds other layers)."""
    args = ctx.server_args
    keys = ("model_path", "tokenizer_path", "revision", "quantization", "kv_cache_dtype", "dtype")
    out = {k: getattr(args, k, None) for k in keys}
    out.update(tp_size=ctx.tp_size, tp_rank=ctx.tp_rank)
    pp_size = getattr(ctx.params, "pp_size", 1)
    if pp_size > 1:  # one-stage identities stay as they were, so existing SSD caches keep their fingerprint
        out.update(pp_size=pp_size, pp_rank=ctx.params.pp_rank)
    return out


def host_budget(requested_bytes: int):
    """This rank's share of host memory by SGLang's own rule for HiCache pools (what is available, less its 10 GiB
    reserve, divided between the ranks of the host); None when SGLang cannot tell."""
    try:
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_bytes
    except ImportError:  # pragma: no cover - sglang 0.5.23 has it
        return None
    try:
        return int(host_memory_budget_bytes(requested_bytes))
    except Exception as e:  # no cgroup or /proc information: fall back to kvtier's own check
        logger.warning("kvtier: SGLang's host memory budget is unknown (%s); checking the machine's instead", e)
        return None
