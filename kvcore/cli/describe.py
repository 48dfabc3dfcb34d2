"""``kvcore describe``: any layout name parsed, its symbolic and concrete shapes for
``--sizes``, its axes, facts and size in bytes, and its sources when a plugin registers it."""

from __future__ import annotations

import argparse
import difflib
import math
from typing import Any

import torch

from kvcore import grammar, registry
from kvcore.cli.formats import format_dict
from kvcore.cli.output import EXIT_OK, EXIT_USAGE, add_json_flag, dtype_name, err, examples_epilog, human_bytes, print_json
from kvcore.cli.plugins import load_plugins_capturing
from kvcore.errors import FormatError
from kvcore.tensor_description import UsageError
from kvcore.tensor_description import parse_dtype as _parse_dtype

#: ``kvcore --help``'s line for the command, and its own help's text above and below the options
HELP = "parse any layout name; render symbolic and concrete shapes"
DESCRIPTION = (
    "Parse a format name (registered or not) in kvcore's layout grammar and print its symbolic shape, its "
    "concrete shape for --sizes, its axes and derived facts, and, if a plugin registers it, its sources. Tokens: NL "
    "layers, NB blocks, BS block size, NBBS fused blocks*tokens (PBS), NH KV heads, HS head size, HSC/HSE a head's "
    "elements split in chunks, BSC/BSE a block's tokens split in groups, CS packed K|V (2*HS), TWO / ONE literal axes, "
    "NP planes, BSV/BSS blocked-scale records; '_' separates axes, '_X_' a list level, ROLE=TEMPLATE+... planes."
)
EPILOG = examples_epilog(
    examples=(
        "kvcore describe NL_X_TWO_NB_BS_NH_HS --sizes NL=32,NB=2048,BS=16,NH=8,HS=128 --dtype bfloat16",
        "# split K (ROCm paged attention): HSE = 16 bytes / 2 = 8 elements from --dtype, HSC = 128 / 8 = 16",
        "kvcore describe K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS --sizes NL=32,NB=2048,BS=16,NH=8,HS=128 --dtype bfloat16",
        "kvcore describe NL_X_NB_NH_BSC_HS_BSE --sizes NL=32,NB=2048,BS=16,NH=8,HS=128,BSE=4",
        "kvcore describe TWO_X_NL_X_NBBS_NH_HS --sizes NL=32,PBS=65536,NH=8,HS=128",
        "kvcore describe NL_X_NB_BS_HS --json",
    ),
    note="a malformed name prints the grammar error and exits 2",
)

_SIZE_KEYS = ("NL", "NB", "BS", "BSC", "BSE", "NBBS", "PBS", "NH", "HS", "HSC", "HSE", "CS", "NP", "VALS", "SCALES")


def parse_sizes(text: str | None) -> dict[str, int]:
    """``"NL=32,NB=2048,BS=16"`` → ``{"NL": 32, "NB": 2048, "BS": 16}``.

    Raises:
        UsageError: an entry without ``=``, an unknown key, or a value that is not a positive int.
    """
    out: dict[str, int] = {}
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise UsageError(f"--sizes entry {part!r} must be KEY=VALUE, e.g. NL=32,NB=2048,BS=16,NH=8,HS=128")
        k, v = (x.strip() for x in part.split("=", 1))
        k = k.upper()
        if k.rsplit(".", 1)[-1] not in _SIZE_KEYS:  # ROLE.TOKEN sizes one plane of a multi-plane name (K.HS=192)
            raise UsageError(f"--sizes key {k!r} is not a size; use {', '.join(_SIZE_KEYS)} (or ROLE.KEY for one plane, e.g. K.HS)")
        try:
            n = int(v)
        except ValueError:
            raise UsageError(f"--sizes {k}={v!r} is not an integer") from None
        if n <= 0:
            raise UsageError(f"--sizes {k}={n} must be positive")
        out[k] = n
    if "NBBS" in out:
        out.setdefault("PBS", out.pop("NBBS"))
    return out


#: Bytes of one head-size chunk (``HSE`` elements) when only a dtype is given: vLLM's ``x``
#: (``16 // element_size``, vllm/attention/ops/paged_attn.py::PagedAttention.get_kv_cache_shape;
#: ROCm paged attention's split K cache).
_CHUNK_BYTES = 16


def _complete_sizes(syn: Any, sizes: dict[str, int], dtype: Any = None, where: str = "") -> dict[str, int]:
    """Fill sizes a format derives from others: PBS = NB*BS, CS = 2*HS (K first, equal K/V
    widths); HSE = 16 bytes / element size when ``dtype`` is given and the name has HSE
    (vLLM's ``x``); HSC = HS / HSE, BSC = BS / BSE, and HS = HSC*HSE, BS = BSC*BSE.

    Raises:
        UsageError: sizes that contradict each other (HSC*HSE != HS, BSC*BSE != BS) or a
            whole that its chunk does not divide (HS=100 with HSE=8); ``where`` names the
            plane (``"K."``).
    """
    s = dict(sizes)
    if "PBS" not in s and "NB" in s and "BS" in s:
        s["PBS"] = s["NB"] * s["BS"]
    if "CS" not in s and "HS" in s:
        s["CS"] = 2 * s["HS"]
    if dtype is not None and "HSE" not in s and syn.has("HSE"):
        esz = torch.empty(0, dtype=dtype).element_size()
        if _CHUNK_BYTES % esz == 0:
            s["HSE"] = _CHUNK_BYTES // esz
    for whole, outer, inner in (("HS", "HSC", "HSE"), ("BS", "BSC", "BSE")):  # chunks / token groups
        if not (syn.has(outer) or syn.has(inner)):
            continue
        w, o, i = s.get(whole), s.get(outer), s.get(inner)
        if w is not None and o is not None and i is not None and o * i != w:
            raise UsageError(f"--sizes {where}{outer}={o} x {where}{inner}={i} = {o * i}, but {where}{whole}={w}; give sizes that agree")
        if w is not None and i is not None and w % i:
            how = f" ({_CHUNK_BYTES} bytes / element size of {dtype})" if inner == "HSE" and inner not in sizes else ""
            raise UsageError(f"--sizes {where}{whole}={w} is not a multiple of {where}{inner}={i}{how}: {where}{outer} would not be whole")
        if w is not None and o is not None and i is None and w % o:
            raise UsageError(f"--sizes {where}{whole}={w} is not a multiple of {where}{outer}={o}")
        if o is None and w is not None and i is not None:
            s[outer] = w // i
        elif i is None and w is not None and o is not None:
            s[inner] = w // o
        elif w is None and o is not None and i is not None:
            s[whole] = o * i
    return s


def _missing_note(token: str, sizes: dict[str, int]) -> str:
    """What to give for a size the format needs and ``--sizes`` did not (derivable ones say how)."""
    tok = token.rsplit(".", 1)[-1]
    if tok == "HSE":
        return f"{token} (elements per head chunk: give HSE=, or --dtype to derive it as 16 bytes / element size, vLLM's x)"
    if tok == "HSC":
        return f"{token} (head chunks: HS / HSE, given HS and HSE or --dtype)"
    if tok == "BSE":
        return f"{token} (tokens per block group: give BSE=)"
    if tok == "BSC":
        return f"{token} (block groups: BS / BSE, given BS and BSE)"
    if tok in ("NBBS", "PBS"):
        return f"{token} (give PBS=, or NB and BS)"
    return token


def _axis_value(tok: str, sizes: dict[str, int]) -> int | None:
    t = grammar.TOKENS[tok]
    if t.literal is not None:
        return t.literal
    if tok == "NBBS":
        return sizes.get("PBS")
    if tok == "BSV":
        return sizes["BS"] * sizes["VALS"] if "BS" in sizes and "VALS" in sizes else None
    if tok == "BSS":
        return sizes["BS"] * sizes["SCALES"] if "BS" in sizes and "SCALES" in sizes else None
    return sizes.get(tok)


def _axis_entry(tok: str, sizes: dict[str, int]) -> dict[str, Any]:
    t = grammar.TOKENS[tok]
    return {"token": tok, "role": t.role.value, "label": t.label, "size": _axis_value(tok, sizes)}


def cmd_describe(args: argparse.Namespace) -> int:
    try:
        syn = grammar.parse(args.name)
    except FormatError as e:
        err(str(e))
        return EXIT_USAGE
    dtype = _parse_dtype(args.dtype) if args.dtype else None
    sizes = _complete_sizes(syn, parse_sizes(args.sizes), dtype)
    load_plugins_capturing()
    fmt = registry.host().formats.get(syn.name)
    axes = [_axis_entry(t, sizes) for t in syn.axes]
    levels = [_axis_entry(t, sizes) for t in syn.list_levels]
    out: dict[str, Any] = {
        "name": syn.name,
        "symbolic": syn.symbolic(),
        "concrete": syn.concrete(sizes) if sizes else None,
        "list_levels": levels,
        "axes": axes,
        "facts": {
            "kv_size": syn.kv_size,
            "is_mla": syn.is_mla,
            "container": syn.container,
            "is_hnd": syn.is_hnd,
            "fused_kv": syn.fused_kv,
            "fused_nbbs": syn.fused_nbbs,
            "two_major": syn.two_major,
            "blocked_scale": syn.blocked_scale,
        },
        "registered": fmt is not None,
    }
    all_sizes = [d["size"] for d in levels + axes]
    if syn.multi_plane:  # each plane its own tensors: axes per plane, elements summed over planes
        out["planes"], all_sizes, counts, shown = [], [], [], []
        for ps in syn.planes:
            psz = _complete_sizes(ps.syntax, grammar.plane_sizes(sizes, ps.role), dtype, f"{ps.role}.")
            shown.append(f"{ps.role}: {ps.syntax.concrete(psz)}")
            toks = ps.syntax.list_levels + ps.syntax.axes
            vals = [_axis_value(t, psz) for t in toks]
            out["planes"].append({"role": ps.role, "template": ps.template, "axes": [{"token": t, "size": v} for t, v in zip(toks, vals)]})
            all_sizes += vals
            counts.append(math.prod(vals) if all(v is not None for v in vals) else None)
        if sizes:
            out["concrete"] = " + ".join(shown)
        if sizes and all(c is not None for c in counts):
            all_sizes = [sum(counts)]
    if sizes and all(v is not None for v in all_sizes):
        elements = math.prod(all_sizes)
        out["elements"] = elements
        nl = sizes.get("NL")
        if nl:
            out["elements_per_layer"] = elements // nl
        if dtype is not None:
            esz = torch.empty(0, dtype=dtype).element_size()
            out["dtype"] = dtype_name(dtype)
            out["bytes"] = elements * esz
            if nl:
                out["bytes_per_layer"] = elements * esz // nl
    elif sizes:
        if syn.multi_plane:
            missing = sorted({f"{p['role']}.{a['token']}" for p in out["planes"] for a in p["axes"] if a["size"] is None})
        else:
            missing = sorted({t for t in syn.list_levels + syn.axes if _axis_value(t, sizes) is None})
        out["missing_sizes"] = missing
    if fmt is not None:
        d = format_dict(fmt)
        out.update({k: d[k] for k in ("engines", "attention_backends", "description", "sources", "plugin")})
    else:
        out["similar"] = difflib.get_close_matches(syn.name, list(registry.host().formats), n=3, cutoff=0.75)
    if args.json:
        print_json(out)
        return EXIT_OK
    print(f"format     {syn.name}" + ("" if fmt is not None else "   (not registered by any plugin)"))
    if out.get("similar"):
        print(f"similar    {', '.join(out['similar'])} (registered)")
    print(f"symbolic   {out['symbolic']}")
    if out["concrete"]:
        print(f"concrete   {out['concrete']}")
    if "missing_sizes" in out:
        print(f"           (no size given for {'; '.join(_missing_note(t, sizes) for t in out['missing_sizes'])})")
    if syn.multi_plane:
        for p in out["planes"]:
            print(f"plane {p['role']:<5}" + ", ".join(a["token"] for a in p["axes"]))
    else:
        print("axes       " + ", ".join(f"{a['token']}={a['role']}" for a in levels + axes))
    f = out["facts"]
    print(
        f"facts      kv_size={f['kv_size']} mla={f['is_mla']} container={f['container']} hnd={f['is_hnd']} "
        f"fused_kv={f['fused_kv']} fused_nbbs={f['fused_nbbs']} kv_major={f['two_major']} blocked_scale={f['blocked_scale']}"
    )
    if "elements" in out:
        line = f"size       {out['elements']:,} elements"
        if "bytes" in out:
            line += f", {out['bytes']:,} bytes ({human_bytes(out['bytes'])}) as {out['dtype']}"
        print(line)
        if "elements_per_layer" in out:
            line = f"per layer  {out['elements_per_layer']:,} elements"
            if "bytes_per_layer" in out:
                line += f", {human_bytes(out['bytes_per_layer'])}"
            print(line)
    if fmt is not None:
        print(f"plugin     {out['plugin']}")
        if fmt.engines or fmt.attention_backends:
            print(
                f"engines    {', '.join(fmt.engines) or '-'}"
                + (f"  (backends: {', '.join(fmt.attention_backends)})" if fmt.attention_backends else "")
            )
        if fmt.description:
            print(f"about      {fmt.description}")
        for i, s in enumerate(fmt.sources):
            print(("sources    " if i == 0 else "           ") + str(s))
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="a format name, e.g. NL_X_TWO_NB_BS_NH_HS")
    p.add_argument(
        "--sizes",
        help="comma-separated sizes: NL, NB, BS, PBS (NBBS), NH, HS, HSC, HSE, BSC, BSE, CS, NP, VALS, SCALES, or ROLE.KEY for "
        "one plane of a multi-plane name (K.HS=192); derived when omitted: PBS = NB*BS, CS = 2*HS, HSE = 16 bytes / element "
        "size with --dtype (vLLM's x), HSC = HS/HSE, BSC = BS/BSE",
    )
    p.add_argument("--dtype", help="element dtype to compute bytes (bfloat16, float16, float8_e4m3fn, uint8, ...)")
    add_json_flag(p)
