"""Is the harness's decoder bit-reproducible on the GPU when only the KV slots differ? (A vs A, A vs B slots.)

Runs a 9-layer Qwen3-8B-width PagedDecoder over a plain per-layer pool: a 2k-token prefill then 32 greedy decode
steps, once in slots A, again in slots A, once in slots B (a permutation); compares every step's logits bitwise,
under several SDPA backends and with torch's deterministic mode.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from kvtier.e2e.model import PagedDecoder, qwen3_config  # noqa: E402


class Pool:
    def __init__(self, layers, n, heads, dim, dtype):
        self.k = [torch.zeros(n, heads, dim, dtype=dtype, device="cuda") for _ in range(layers)]
        self.v = [torch.zeros(n, heads, dim, dtype=dtype, device="cuda") for _ in range(layers)]

    def set_kv_buffer(self, layer, loc, k, v, layer_id_override):
        self.k[layer_id_override][loc] = k
        self.v[layer_id_override][loc] = v

    def get_key_buffer(self, i):
        return self.k[i]

    def get_value_buffer(self, i):
        return self.v[i]


def run(m, pool, prompt, slots, steps, split=0):
    n = prompt.numel()
    if split:  # a cached prefix, then the extend of the rest (the warm-cache path)
        m.forward(pool, prompt[:split], 0, slots[:split], slots[:split])
        logits = [m.forward(pool, prompt[split:], split, slots[split:n], slots[:n])]
    else:
        logits = [m.forward(pool, prompt, 0, slots[:n], slots[:n])]
    tok = int(logits[-1].argmax())
    out = [tok]
    for j in range(steps):
        pos = n + j
        logits.append(m.forward(pool, torch.tensor([tok], device="cuda"), pos, slots[pos:pos + 1], slots[:pos + 1]))
        tok = int(logits[-1].argmax())
        out.append(tok)
    return torch.stack(logits), out


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = qwen3_config(num_layers=9)
    m = PagedDecoder.from_config(cfg, device="cuda")
    n, steps, total = 2048, 32, 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(1, cfg.vocab_size, (n,), device="cuda", generator=g)
    a = torch.randperm(total, device="cuda", generator=g)[: n + steps + 1]
    b = torch.randperm(total, device="cuda", generator=g)[: n + steps + 1]
    res = {}
    variants = {"model_default": None, "model_default_extend": None}
    if os.environ.get("PROBE_SGLANG"):
        variants = {"default": None}
    for name, backends in variants.items():
        try:
            ctx = sdpa_kernel(backends) if backends else torch.autocast("cuda", enabled=False)
            with ctx:
                pools = [Pool(9, total, 8, 128, torch.bfloat16) for _ in range(3)]
                split = 1536 if name.endswith("extend") else 0
                la, oa = run(m, pools[0], prompt, a, steps, split)
                la2, oa2 = run(m, pools[1], prompt, a, steps, split)
                lb, ob = run(m, pools[2], prompt, b, steps, split)
            d = lambda x, y: [float((x[i] - y[i]).abs().max()) for i in range(x.shape[0])]  # noqa: E731
            res[name] = {"AA_maxdiff": d(la, la2), "AB_maxdiff": d(la, lb), "AA_tokens_equal": oa == oa2,
                         "AB_tokens_equal": oa == ob}
        except Exception as e:  # a backend that cannot run these shapes
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(name, {k: (v if not isinstance(v, list) else [(i, round(x, 4)) for i, x in enumerate(v) if x])
                     for k, v in res[name].items()}, flush=True)
    if os.environ.get("PROBE_SGLANG"):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=16))

        class Direct:
            def __init__(self, pool):
                self.pool = pool

            def set_kv_buffer(self, layer, loc, k, v, layer_id_override):
                self.pool.k_buffer[layer_id_override][loc] = k
                self.pool.v_buffer[layer_id_override][loc] = v

            def get_key_buffer(self, i):
                return self.pool.get_key_buffer(i)

            def get_value_buffer(self, i):
                return self.pool.get_value_buffer(i)

        def sgl():
            return MHATokenToKVPool(size=total, page_size=16, dtype=torch.bfloat16, head_num=8, head_dim=128,
                                    layer_num=9, device="cuda", enable_memory_saver=False)

        for name, make in (("sglang_setter", sgl), ("sglang_direct_write", lambda: Direct(sgl()))):
            pools = [make() for _ in range(3)]
            la, oa = run(m, pools[0], prompt, a + 16, steps)
            la2, oa2 = run(m, pools[1], prompt, a + 16, steps)
            lb, ob = run(m, pools[2], prompt, b + 16, steps)
            d = lambda x, y: [float((x[i] - y[i]).abs().max()) for i in range(x.shape[0])]  # noqa: E731
            res[name] = {"AA_maxdiff": d(la, la2), "AB_maxdiff": d(la, lb), "AA_tokens_equal": oa == oa2,
                         "AB_tokens_equal": oa == ob}
            print(name, {k: (v if not isinstance(v, list) else [round(x, 4) for x in v[:8]] + ["..."]) for k, v in
                         res[name].items()}, flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "probe_determinism.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
