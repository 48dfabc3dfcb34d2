"""kvcore inside a real vLLM (CPU): every cache the engine wrote is read right, and a request
continues exactly from KV that kvcore took out and put back.

Each case runs vLLM in-process on a tiny model written by :mod:`.harness` and

1. records every row vLLM's cache writers received while it generates (the truth), detects the
   layout of each KV-cache group from the engine's own objects only
   (:func:`kvcore_vllm.detect_engine`: no hand-written hint), and gathers each layer's rows at
   the recorded slots: they must be the rows the writer received;
2. pauses a request mid-decode (its last block partial), gathers its KV token by token,
   overwrites all of its blocks with garbage, scatters the KV back, and lets it continue:
   greedy tokens must equal an undisturbed run; the negative controls (garbage left in place,
   or KV put back through the Python view's reading that the kernel does not use) must change
   the output.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from kvcore_vllm import detect_engine

import kvcore

from .harness import VERSION, SamplingParams, close, make_llm, prompt, record_writes, runner_of, scheduler_of, tiny_model

AMX = torch.cpu._is_amx_tile_supported()
# vLLM CPU selects CPU_MLA from 0.28 and AMX_MLA from 0.29 (platforms/cpu.py), but 0.28's CPU_MLA does not import
# (mla/cpu_mla.py: fa_utils has no compile_flash_attn_varlen_func_from_specs); 0.32 runs both
MLA_RUNS = VERSION >= (0, 32)


@contextlib.contextmanager
def _without_amx():
    """vLLM on a CPU without AMX tiles: ``_get_attn_isa`` then picks the vec path for bfloat16."""
    orig = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: False
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = orig


# (family, model dtype, kv cache dtype, block size, AMX allowed or the attention backend to force)
CASES = [
    ("llama", "bfloat16", "auto", 32, True),
    ("llama", "bfloat16", "auto", 128, True),
    ("llama", "bfloat16", "auto", 64, False),
    ("llama", "float16", "auto", 32, True),
    ("llama", "bfloat16", "fp8_e4m3", 32, True),
    ("llama", "float16", "fp8_e5m2", 64, True),
    ("qwen3", "bfloat16", "auto", 32, True),
    ("qwen2", "float16", "auto", 32, True),
    ("gemma2", "bfloat16", "auto", 32, True),
    ("granitehybrid", "bfloat16", "auto", 32, True),
]
if VERSION < (0, 29):
    # the older release's run proves its era's packing with one case per kernel path, dtype class and model kind
    # (the current release runs every case)
    CASES = [c for c in CASES if c[0] in ("llama", "gemma2", "granitehybrid") and c[3] != 128]
if MLA_RUNS:
    CASES += [("deepseek_v2", "bfloat16", "auto", 32, True), ("deepseek_v2", "bfloat16", "auto", 32, "CPU_MLA")]


def _id(c) -> str:
    fam, dt, kvd, bs, amx = c
    return f"{fam}-{dt}-{kvd}-bs{bs}" + ("" if amx is True else "-noamx" if amx is False else f"-{amx}")


_ids = itertools.count()


@pytest.fixture(scope="module", params=CASES, ids=_id)
def engine(request, tmp_path_factory):
    fam, dt, kvd, bs, amx = request.param
    path = tiny_model(tmp_path_factory.mktemp("models"), fam, dt)
    with contextlib.ExitStack() as stack:
        if not amx:
            stack.enter_context(_without_amx())
        log = stack.enter_context(record_writes())
        backend = {"attention_backend": amx} if isinstance(amx, str) else {}
        llm = make_llm(path, dtype=dt, block_size=bs, kv_cache_dtype=kvd, prefix_caching=False, **backend)
        first = prompt(150, seed=1)
        out = llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=6, temperature=0.0, detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    yield llm, log, request.param
    close(llm)


def _layer_tensor(runner, name: str) -> torch.Tensor:
    kv = runner.compilation_config.static_forward_context[name].kv_cache
    return kv[0] if isinstance(kv, (list, tuple)) else kv


def _close_fp8(have: torch.Tensor, want: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Per row: every element of ``have`` (fp8) is ``want`` converted by vLLM's fp8 store
    (truncating, saturating at the largest finite value): within one fp8 step of it."""
    h = have.view(fp8).float()
    w = want.float().clamp(-torch.finfo(fp8).max, torch.finfo(fp8).max)
    mantissa, tiny = (3, 2.0**-9) if fp8 == torch.float8_e4m3fn else (2, 2.0**-16)  # bits; the subnormal step
    step = torch.clamp(w.abs() * 2.0**-mantissa, min=tiny)
    return ((h - w).abs() <= step * 1.01).all(-1)


def test_every_row_vllm_wrote_is_gathered_right(engine):
    llm, log, (fam, dt, kvd, bs, amx) = engine
    runner = runner_of(llm)
    layouts = detect_engine(runner)
    assert layouts.kv_groups, "no KV group detected"
    if fam == "granitehybrid":
        assert [g.layout is None for g in layouts.groups] == [True, False]  # Mamba state, then attention
    if fam == "gemma2":
        assert len(layouts.kv_groups) == 2  # sliding window and full attention over one buffer
    checked = 0
    for g in layouts.kv_groups:
        if isinstance(amx, str):
            assert g.backend == amx
        if g.kind == "attention" and amx is False:
            assert g.hints["cpu_attn_isa"] != "amx"
        for li, name in enumerate(g.layer_names):
            t = _layer_tensor(runner, name)
            slots, ks, vs = log.rows(t.data_ptr())
            got = kvcore.gather(g.layout, slots)
            fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(kvd)
            for kv, rows in enumerate([ks] if vs is None else [ks, vs]):
                want = rows.reshape(len(slots), -1)
                have = got[kv, li]
                if fp8 is not None:
                    ok = _close_fp8(have, want, fp8)
                else:
                    ok = (
                        have.view(torch.uint8).reshape(len(slots), -1) == want.to(have.dtype).view(torch.uint8).reshape(len(slots), -1)
                    ).all(-1)
                assert ok.all(), f"{name} {'KV'[kv]}: {int((~ok).sum())} of {len(slots)} rows differ from what vLLM's writer received"
                checked += len(slots)
    assert checked > 150


def _slots(block_ids: list[int], n_tokens: int, manager_bs: int, kernel_bs: int) -> torch.Tensor:
    """Slots (kernel blocks) of a request's first ``n_tokens`` tokens; tokens in freed
    sliding-window blocks (vLLM's null block 0) are -1 (skipped)."""
    i = torch.arange(n_tokens)
    mb = torch.tensor(block_ids, dtype=torch.int64)[i // manager_bs]
    ratio = manager_bs // kernel_bs
    kb = mb * ratio + (i % manager_bs) // kernel_bs
    return torch.where(mb > 0, kb * kernel_bs + i % kernel_bs, torch.full_like(kb, -1))


def _continue(llm, tokens: list[int], total: int, pause_after: int, meddle=None) -> list[int]:
    """Run one request step by step; after ``pause_after`` generated tokens call
    ``meddle(request_id, num_computed_tokens)``; return all generated tokens."""
    rid = f"req-{next(_ids)}"
    eng = llm.llm_engine
    eng.add_request(rid, {"prompt_token_ids": tokens}, SamplingParams(max_tokens=total, temperature=0.0, detokenize=False, ignore_eos=True))
    out: list[int] = []
    done = False
    while not done:
        for o in eng.step():
            if o.request_id == rid:
                out = list(o.outputs[0].token_ids)
                done = o.finished
        if meddle is not None and len(out) == pause_after and not done:
            sched = scheduler_of(llm)
            (inner,) = [k for k in sched.requests if k == rid or k.startswith(rid + "-")]  # vLLM may suffix ids
            meddle(inner, sched.requests[inner].num_computed_tokens)
            meddle = None
    return out


def _junk(like: torch.Tensor, cache_dtype: str, g: torch.Generator) -> torch.Tensor:
    """Finite garbage shaped like ``like``: the kernel multiplies masked positions of a partial
    block by a zero weight, so NaN garbage would poison even a correct restore."""
    x = torch.randn(like.shape, generator=g) * 4
    if like.dtype == torch.uint8:  # an fp8 cache (vLLM CPU stores fp8 as uint8)
        fp8 = torch.float8_e5m2 if cache_dtype.endswith("e5m2") else torch.float8_e4m3fn
        return x.to(fp8).view(torch.uint8)
    return x.to(like.dtype)


def _wrong_reading(t: torch.Tensor) -> object:
    """The reading the Python view suggests and the kernel does not use: per (block, head),
    K then V rows of ``[BS, HS]`` (``view(NB, NH, 2*BS, HS).chunk(2, dim=2)``)."""
    return kvcore.build_layout("NL_X_NB_NH_TWO_BS_HS", [t.view(t.shape[0], t.shape[1], 2, t.shape[2], -1)])


@pytest.mark.parametrize("control", ["restore", "no-restore", "python-view"])
def test_request_continues_exactly_from_kv_taken_out_and_put_back(engine, control):
    llm, _, (fam, dt, kvd, bs, amx) = engine
    if control == "python-view" and fam == "deepseek_v2":
        pytest.skip("MLA rows have no K/V view to misread")
    runner = runner_of(llm)
    layouts = detect_engine(runner)
    tokens = prompt(100, seed=7)  # 100 tokens: the last block is partial whatever the block size
    want = _continue(llm, tokens, 12, pause_after=0)
    g = torch.Generator().manual_seed(3)

    def meddle(rid: str, n: int) -> None:
        mgr = scheduler_of(llm).kv_cache_manager
        ids = mgr.get_block_ids(rid)
        for grp in layouts.kv_groups:
            lay = grp.layout
            slots = _slots(ids[grp.index], n, grp.spec.block_size, lay.block_size)
            assert n % lay.block_size != 0 or control != "restore"
            staged = kvcore.gather(lay, slots)
            if control == "python-view":
                staged = [kvcore.gather(_wrong_reading(_layer_tensor(runner, nm)), slots) for nm in grp.layer_names]
            kernel_blocks = torch.unique(slots[slots >= 0] // lay.block_size)
            for nm in grp.layer_names:
                t = _layer_tensor(runner, nm)
                t[kernel_blocks] = _junk(t[kernel_blocks], kvd, g)
            if control == "restore":
                kvcore.scatter(lay, slots, staged)
            elif control == "python-view":
                for nm, st in zip(grp.layer_names, staged):
                    kvcore.scatter(_wrong_reading(_layer_tensor(runner, nm)), slots, st)

    got = _continue(llm, tokens, 12, pause_after=3, meddle=meddle)
    if control == "restore":
        assert got == want, "the continuation differs from an undisturbed run after kvcore restored the KV"
    else:
        assert got[:3] == want[:3]
        assert got != want, f"negative control {control!r} did not change the output: the test could not see a wrong restore"
