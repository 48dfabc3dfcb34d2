"""``kvcore demo --engine transformers``: kvcore on KV that a real engine computed and laid out.

Part 1, the continuous-batching paged cache (transformers 5.18 - 5.24):

1. build a small Llama from a config (random weights, fixed seed, nothing downloaded) and
   run transformers' continuous batching on prompts of mixed lengths;
2. hold one request's blocks when it finishes, the way an offloading connector keeps a
   finished request's blocks until it has saved them (the demo wraps the live
   ``PagedAttentionCache.free_blocks``; every other request is freed as usual);
3. ``kvcore.detect`` the live cache, offload the held blocks to a staging buffer
   (``gather_blocks``), wipe them, allocate other free blocks from transformers' own pool
   and restore there (``scatter_blocks``);
4. prove it two ways: the restored blocks are bit-exact copies of the originals; and the
   K/V kvcore gathers for the request's tokens equal the K/V the same model stores in a
   ``DynamicCache`` for the same tokens (an oracle independent of kvcore: the cache's own
   ``layers[i].keys / .values``), to ``--rtol`` (1e-5) times the largest |K/V| (float32; the two runs use
   different attention kernels and batch compositions, so bitwise equality is not
   expected). Two wrong readings of the same bytes (the HND twin layout, K and V
   swapped) are shown failing that oracle, to show it can fail.

Part 2, ``DynamicCache``: prefill a prompt, offload the cache with ``kvcore.gather``,
drop it, rebuild a new ``DynamicCache`` by ``kvcore.scatter`` into freshly allocated
layers, continue greedy generation from it, and compare with an uninterrupted run:
the tokens must be identical (and the rebuilt tensors bit-exact).

Exit code 0 when every check passes, 1 on any difference.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import torch

import kvcore
from kvcore.cli_args import OneLineParser, float_range, int_list, int_range

from .caches import kv_caches, paged_groups
from .paged import request_slots
from .versions import check_version

__all__ = ["run", "main", "build_model"]


def build_model(seed: int, num_layers: int = 4, dtype: torch.dtype = torch.float32):
    """A small random Llama (no download): 4 layers, 4 query heads, 2 KV heads, head size 16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,  # wider than the default 0.02, so that greedy decoding does not settle on one token
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _run_continuous_batching(model, prompts, keep: str, max_new_tokens: int, page_size: int, num_blocks: int):
    """Run transformers' continuous batching; hold request ``keep``'s blocks when it finishes."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=128, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    t0 = time.time()
    while getattr(manager, "batch_processor", None) is None:
        if not manager.is_running() or time.time() - t0 > 60:
            manager.stop(block=True)
            raise kvcore.KVCoreError("transformers' continuous batching did not start")
        time.sleep(0.005)
    cache = manager.batch_processor.cache
    held: dict[str, list[int]] = {}
    free = cache.free_blocks

    def free_blocks(request_id, no_cache=False):
        if request_id == keep:  # the connector keeps these blocks until it has offloaded them
            held.update({name: list(a.block_table.get(request_id, [])) for name, a in cache.cache_allocators.items()})
            return None
        return free(request_id, no_cache)

    cache.free_blocks = free_blocks
    ids = []
    for i, p in enumerate(prompts):
        ids.append(manager.add_request(p, request_id=keep if i == 0 else f"req_{i}", max_new_tokens=max_new_tokens))
    results = {}
    deadline = time.time() + 120
    while len(results) < len(ids) and time.time() < deadline:
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            results[r.request_id] = r
        elif r is None and not manager.is_running():
            break
    manager.stop(block=True)
    return cache, held, results


def part_paged(model, args, out: dict[str, Any]) -> bool:
    lengths = list(args.prompt_lengths)
    prompts = _prompts(args.seed, lengths, model.config.vocab_size)
    # request "keep" gets the longest prompt so that it spans several blocks
    prompts.sort(key=len, reverse=True)
    t0 = time.time()
    cache, held, results = _run_continuous_batching(model, prompts, "keep", args.max_new_tokens, args.page_size, args.num_blocks)
    out["cb_seconds"] = round(time.time() - t0, 2)
    errors = [f"{k}: {r.error}" for k, r in results.items() if r.error]
    if len(results) != len(prompts) or errors or not held.get("full_attention"):
        out["error"] = f"continuous batching did not finish every request ({len(results)}/{len(prompts)}; {errors})"
        return False
    res = results["keep"]
    tokens = list(res.prompt_ids) + list(res.generated_tokens)[:-1]  # the last generated token is never cached
    n = len(tokens)
    layout = kvcore.detect(cache, engine="transformers")
    group = paged_groups(cache)["full_attention"]
    blocks = held["full_attention"]
    out["requests"] = {k: {"prompt_len": len(r.prompt_ids), "generated": list(r.generated_tokens)} for k, r in results.items()}
    out["layout"] = {
        "format": layout.format.name,
        "concrete": layout.describe(),
        "num_layers": layout.num_layers,
        "num_blocks": layout.num_blocks,
        "block_size": layout.block_size,
        "num_heads": layout.num_heads,
        "head_size": layout.head_size,
        "dtype": str(layout.dtype).replace("torch.", ""),
        "cache_tensor": f"{list(cache.cache_tensor.shape)} {cache.cache_tensor.dtype}",
    }
    out["request"] = {"id": "keep", "tokens_cached": n, "blocks": blocks}
    slots = request_slots(group, blocks, n)
    with torch.no_grad():
        before_tokens = kvcore.gather(layout, slots)  # [2, NL, n, NH*HS]
        before_blocks = group.view[blocks].clone()
        staged = kvcore.gather_blocks(layout, blocks)  # offload: [2, NL, len(blocks)*BS, NH*HS]
        group.view[blocks] = float("nan")  # wipe the request's blocks
        wiped = not bool(torch.equal(kvcore.gather(layout, slots), before_tokens))
        # restore into other free blocks, allocated from transformers' own pool
        alloc = group.allocator
        while cache.pool.count_free_blocks(alloc.index) < len(blocks):
            cache.pool.allocate_sector(alloc.index)
        new_blocks = cache.pool.get_free_blocks(alloc.index, len(blocks))
        kvcore.scatter_blocks(layout, new_blocks, staged)
        after_blocks = group.view[new_blocks]
        bit_exact = bool(torch.equal(after_blocks.view(torch.uint8), before_blocks.view(torch.uint8)))
        new_slots = request_slots(group, new_blocks, n)
        restored = kvcore.gather(layout, new_slots)
        tokens_exact = bool(torch.equal(restored.view(torch.uint8), before_tokens.view(torch.uint8)))
    out["offload"] = {
        "staging_shape": list(staged.shape),
        "staging_bytes": staged.numel() * staged.element_size(),
        "wiped_blocks_differ": wiped,
        "restored_into": new_blocks,
        "blocks_bit_exact": bit_exact,
        "request_tokens_bit_exact": tokens_exact,
    }
    # oracle: the same model's DynamicCache for the same tokens, read through its own tensors
    with torch.no_grad():
        dyn = _cache_of(model(input_ids=torch.tensor([tokens]), use_cache=True))
    pairs = kv_caches(dyn)
    nh, hs = layout.num_heads, layout.head_size
    ref_k = torch.stack([k[0].transpose(0, 1).reshape(n, nh * hs) for k, _ in pairs])  # [NL, n, NH*HS]
    ref_v = torch.stack([v[0].transpose(0, 1).reshape(n, nh * hs) for _, v in pairs])
    err_k, err_v = _max_err(restored[0], ref_k), _max_err(restored[1], ref_v)
    scale = float(torch.stack([ref_k, ref_v]).abs().max())
    # negative controls: the same bytes read wrongly
    hnd = group.view.view(group.view.shape[0], group.view.shape[1], 2, nh, layout.block_size, hs)
    wrong_hnd = kvcore.gather(kvcore.build_layout("NB_NL_TWO_NH_BS_HS", hnd), new_slots)
    err_hnd = max(_max_err(wrong_hnd[0], ref_k), _max_err(wrong_hnd[1], ref_v))
    err_swap = max(_max_err(restored[1], ref_k), _max_err(restored[0], ref_v))
    tol = args.rtol * scale
    oracle_ok = err_k <= tol and err_v <= tol
    controls_fail = err_hnd > tol and err_swap > tol
    out["oracle"] = {
        "reference": "DynamicCache of the same model and tokens (cache.layers[i].keys/.values)",
        "max_abs_err_K": err_k,
        "max_abs_err_V": err_v,
        "max_abs_value": scale,
        "rtol": args.rtol,
        "tolerance": tol,
        "pass": oracle_ok,
        "wrong_layout_HND_err": err_hnd,
        "wrong_K_V_swapped_err": err_swap,
        "controls_fail_as_they_should": controls_fail,
    }
    return bool(wiped and bit_exact and tokens_exact and oracle_ok and controls_fail)


def _cache_of(output):
    """The cache of a forward pass: ``output.cache`` (transformers 5.2x) or ``output.past_key_values``."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _cache_kwarg(model) -> str:
    """``cache`` where ``generate`` takes it (transformers 5.2x deprecates ``past_key_values``), else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _new_dynamic_cache(model, pairs_like: list[tuple[torch.Tensor, torch.Tensor]]):
    """A fresh DynamicCache with one zero-filled layer per layer, allocated through
    transformers' own ``update`` (so the tensors are the cache's own)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 takes no config
        cache = DynamicCache()
    for i, (k, v) in enumerate(pairs_like):
        cache.update(torch.zeros_like(k), torch.zeros_like(v), i)
    return cache


def part_dynamic(model, args, out: dict[str, Any]) -> bool:
    g = torch.Generator().manual_seed(args.seed + 2)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.dynamic_prompt_len), generator=g)
    with torch.no_grad():
        kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        reference = model.generate(prompt, **kw)[0, prompt.shape[1] :].tolist()
        prefill = _cache_of(model(input_ids=prompt[:, :-1], use_cache=True))
        layout = kvcore.detect(prefill, engine="transformers")
        n = prompt.shape[1] - 1
        slots = torch.arange(n)
        staged = kvcore.gather(layout, slots).clone()  # offload: [2, NL, n, NH*HS]
        originals = [(k.clone(), v.clone()) for k, v in kv_caches(prefill)]
        shapes = [(k, v) for k, v in originals]
        del prefill, layout
        rebuilt = _new_dynamic_cache(model, shapes)
        new_layout = kvcore.detect(rebuilt, engine="transformers")
        kvcore.scatter(new_layout, slots, staged)
        exact = all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv_caches(rebuilt), originals))
        continued = model.generate(prompt, **{_cache_kwarg(model): rebuilt}, **kw)[0, prompt.shape[1] :].tolist()
    same = continued == reference
    out["dynamic"] = {
        "format": new_layout.format.name,
        "concrete": new_layout.describe(),
        "prompt_len": prompt.shape[1],
        "offloaded_tokens": n,
        "staging_shape": list(staged.shape),
        "rebuilt_bit_exact": exact,
        "uninterrupted": reference,
        "from_rebuilt_cache": continued,
        "identical": same,
    }
    return bool(exact and same)


def run(argv: list[str] | None = None) -> int:
    """Run the demo; print what it did; return 0 when every check passes, else 1."""
    p = OneLineParser(prog="kvcore demo --engine transformers", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0)
    p.add_argument(
        "--prompt-lengths",
        type=int_list(1, 4096),
        default="37,5,21,50,12",
        help="comma-separated prompt lengths (the longest is offloaded)",
    )
    p.add_argument("--max-new-tokens", type=int_range(1, 4096), default=8)
    p.add_argument("--page-size", type=int_range(1, 4096), default=16)
    p.add_argument("--num-blocks", type=int_range(1, 1 << 20), default=32)
    p.add_argument("--dynamic-prompt-len", type=int_range(1, 4096), default=29)
    p.add_argument("--rtol", type=float_range(0, 1), default=1e-5, help="oracle tolerance: max |err| <= rtol * max |K/V| (float32 model)")
    args = p.parse_args(argv)
    if not args.rtol > 0:
        p.error(f"--rtol must be positive, got {args.rtol}")
    t0 = time.time()
    out: dict[str, Any] = {"engine": "transformers"}
    try:
        out["transformers"] = check_version("continuous-batching demo", paged=True)
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        logging.getLogger("transformers").setLevel(logging.ERROR)
        model = build_model(args.seed)
        out["model"] = f"LlamaForCausalLM(4 layers, hidden 64, 4 heads, 2 KV heads, head 16, float32, random seed {args.seed})"
        ok_paged = part_paged(model, args, out)
        ok_dyn = part_dynamic(model, args, out)
        ok = ok_paged and ok_dyn
    except kvcore.KVCoreError as e:
        out["error"] = f"{type(e).__name__}: {e}"
        ok = False
    out["seconds"] = round(time.time() - t0, 2)
    out["ok"] = ok
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _report(out)
    return 0 if ok else 1


def _report(o: dict[str, Any]) -> None:
    w = print
    w(f"kvcore demo --engine transformers (transformers {o.get('transformers', '?')})")
    if "model" in o:
        w(f"  model: {o['model']}")
    if "requests" in o:
        lens = ", ".join(f"{k}={v['prompt_len']}" for k, v in o["requests"].items())
        w(f"  continuous batching: {len(o['requests'])} prompts ({lens} tokens), greedy, {o['cb_seconds']} s")
    if "layout" in o:
        lay = o["layout"]
        w(f"  live paged cache: one {lay['cache_tensor']} tensor")
        w(
            f"    detected {lay['format']} = {lay['concrete']} ({lay['dtype']}: NL={lay['num_layers']} NB={lay['num_blocks']} "
            f"BS={lay['block_size']} NH={lay['num_heads']} HS={lay['head_size']})"
        )
    if "offload" in o:
        r, f = o["request"], o["offload"]
        w(f"  request 'keep': {r['tokens_cached']} cached tokens in blocks {r['blocks']}")
        w(f"    offloaded to staging {f['staging_shape']} ({f['staging_bytes']} bytes), wiped (reads differ: {f['wiped_blocks_differ']})")
        w(
            f"    restored into free blocks {f['restored_into']}: blocks bit-exact {f['blocks_bit_exact']}, "
            f"request tokens bit-exact {f['request_tokens_bit_exact']}"
        )
    if "oracle" in o:
        c = o["oracle"]
        w(f"  oracle ({c['reference']}):")
        w(
            f"    max |err| K {c['max_abs_err_K']:.3g}, V {c['max_abs_err_V']:.3g} (values up to {c['max_abs_value']:.3g}; "
            f"tolerance {c['rtol']:g} x that = {c['tolerance']:.3g}): "
            f"{'PASS' if c['pass'] else 'FAIL'}"
        )
        w(
            f"    controls: HND misreading err {c['wrong_layout_HND_err']:.3g}, K/V swapped err {c['wrong_K_V_swapped_err']:.3g}: "
            f"{'caught' if c['controls_fail_as_they_should'] else 'NOT caught'}"
        )
    if "dynamic" in o:
        d = o["dynamic"]
        w(f"  DynamicCache: prefill {d['offloaded_tokens']} tokens, detected {d['format']} = {d['concrete']}")
        w(f"    offloaded to {d['staging_shape']}, rebuilt a new DynamicCache by scatter: bit-exact {d['rebuilt_bit_exact']}")
        w(f"    greedy continuation {d['from_rebuilt_cache']}")
        w(f"    uninterrupted run   {d['uninterrupted']}: {'identical' if d['identical'] else 'DIFFERENT'}")
    if o.get("error"):
        w(f"  error: {o['error']}")
    w(f"  {'OK' if o['ok'] else 'FAILED'} in {o['seconds']} s")


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
