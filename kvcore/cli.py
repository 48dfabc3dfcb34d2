"""The ``kvcore`` command line.

Subcommands (``kvcore COMMAND --help`` explains each, with examples)::

    kvcore plugins  [--json]                      what loaded, from where, what it registered
    kvcore formats  [--json] [--engine E]         every registered layout, with its source
    kvcore hints    [ENGINE] [--json]             the hints an engine's plugins read
    kvcore describe NAME [--sizes NL=32,...]      parse any layout name, render its shape
    kvcore detect   FILE|- [--engine E] [--hints JSON] [--json] [--per-layer]
                                                  detect a cache described in JSON (from a log)
    kvcore doctor   [--json]                      versions, devices, kernels, compilers
    kvcore demo     [--engine vllm] [ARGS...]     run a plugin's end-to-end demo
    kvcore bench    ...                           transfer benchmarks (kvcore.bench)
    kvcore check    ...                           the conformance suite (kvcore.testing.check)

Exit codes: 0 success; 1 the question was understood but the answer is a failure
(nothing recognises the cache, a demo or check found a mismatch); 2 a usage error (bad
arguments, a malformed format name, an unreadable input file, an unknown demo, a missing
optional module). ``--json`` output goes to stdout alone; diagnostics go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import shutil
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import kvcore
from kvcore import kernels, registry
from kvcore.cli_args import OneLineParser
from kvcore.detection import known_engines
from kvcore.dtypes import described_tensors
from kvcore.errors import FormatError, KVCoreError, TransferError
from kvcore.grammar import TOKENS, parse, plane_sizes
from kvcore.kernels import select_kernel
from kvcore.tensor_description import UsageError, load_tensor_description
from kvcore.tensor_description import parse_dtype as _parse_dtype

__all__ = ["main", "build_parser", "load_tensor_description", "parse_sizes", "UsageError"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


# -- small output helpers ----------------------------------------------------------------


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain left-aligned text table."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _fill(text: str, width: int = 100, **kw: Any) -> str:
    """``textwrap.fill`` that never breaks a word or at a hyphen: a path, a file name or a
    command stays on one line whole (copy-paste), even past ``width``."""
    return textwrap.fill(text, width=width, break_long_words=False, break_on_hyphens=False, **kw)


def _err(msg: str) -> None:
    print(f"kvcore: {msg}", file=sys.stderr)


def _dtype_name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def _format_facts(fmt: Any) -> list[str]:
    syn = fmt.syntax
    facts = [syn.container]
    if syn.is_mla:
        facts.append("MLA")
    facts.append("HND" if syn.is_hnd else ("NHD" if syn.has("NH") and syn.has("BS") else "-"))
    if syn.fused_kv:
        facts.append("fused-KV")
    if syn.fused_nbbs:
        facts.append("NBBS")
    if syn.two_major:
        facts.append("KV-major")
    if syn.blocked_scale:
        facts.append("blocked-scale")
    return facts


def _format_dict(fmt: Any) -> dict[str, Any]:
    try:
        owner = registry.format_owner(fmt.name)
    except KeyError:
        owner = None
    return {
        "name": fmt.name,
        "symbolic": fmt.symbolic,
        "kv_size": fmt.kv_size,
        "is_mla": fmt.is_mla,
        "container": fmt.container,
        "is_hnd": fmt.is_hnd,
        "fused_kv": fmt.fused_kv,
        "fused_nbbs": fmt.fused_nbbs,
        "two_major": fmt.two_major,
        "engines": list(fmt.engines),
        "attention_backends": list(fmt.attention_backends),
        "description": fmt.description,
        "sources": [{"engine": s.engine, "version": s.version, "file": s.file} for s in fmt.sources],
        "plugin": owner,
        "plugins": list(registry.declarations(fmt.name)),
    }


# -- plugins -----------------------------------------------------------------------------


def _load_plugins_capturing(report: bool = True) -> list[str]:
    """Load plugins; the warnings loading produced (a plugin that failed to import) are
    returned, and printed to stderr as one line each when ``report``."""

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry.host()
    msgs = [str(w.message) for w in caught]
    if report:
        for m in msgs:
            _err(f"warning: {m}")
    return msgs


def cmd_plugins(args: argparse.Namespace) -> int:
    _load_plugins_capturing(report=False)
    infos = kvcore.plugins()
    if args.json:
        _print_json([i.as_dict() for i in infos])
        return EXIT_OK
    rows = []
    for i in infos:
        dist = f"{i.distribution} {i.version or ''}".strip() if i.distribution else "(registered in code)"
        if i.error:
            rows.append([i.name, dist, "FAILED", "", "", i.error])
        else:
            rows.append(
                [i.name, dist, "ok", len(i.formats), ", ".join(i.kernels) or "-", ", ".join(h.replace("kvcore_", "") for h in i.hooks)]
            )
    print(_table(rows, ["plugin", "distribution", "status", "formats", "kernels", "hooks / error"]))
    for i in infos:
        if i.formats and args.verbose:
            print(f"\n{i.name} registers:")
            for f in i.formats:
                print(f"  {f}")
    failed = [i for i in infos if i.error]
    if failed:
        print(
            f"\n{len(failed)} plugin(s) failed to load; fix or uninstall them, or set KVCORE_DISABLE_PLUGINS="
            + ",".join(i.name for i in failed),
            file=sys.stderr,
        )
    return EXIT_OK


# -- formats -----------------------------------------------------------------------------


def cmd_formats(args: argparse.Namespace) -> int:
    _load_plugins_capturing()
    fmts = kvcore.formats()
    if args.engine:
        known = sorted({e for f in fmts for e in f.engines})
        fmts = registry.formats_for_engine(args.engine)  # declared for it, or returned for it by its fixtures
        if not fmts:
            raise UsageError(f"no registered format names engine {args.engine!r}; engines with formats: {', '.join(known) or 'none'}")
    if args.json:
        _print_json([_format_dict(f) for f in fmts])
        return EXIT_OK
    if not fmts:
        if not args.engine:
            print("no formats are registered: install an engine plugin (e.g. kvcore-vllm); `kvcore plugins` shows what loaded")
        return EXIT_OK
    rows = []
    for f in fmts:
        d = _format_dict(f)
        src = str(f.sources[0]) if f.sources else "-"
        if len(f.sources) > 1:
            src += f" (+{len(f.sources) - 1} more)"
        eng = ",".join(f.engines) or "-"
        if f.attention_backends:
            eng += " / " + ",".join(f.attention_backends)
        if not args.wide:
            eng, src = _clip(eng, 44), _clip(src, 72)
        rows.append([f.name, f.symbolic, f.kv_size, " ".join(_format_facts(f)), eng, src, ", ".join(d["plugins"]) or d["plugin"]])
    print(_table(rows, ["name", "shape", "kv", "facts", "engines / backends", "source", "plugins"]))
    if not args.wide:
        print("\n(engines and sources clipped: --wide shows them whole, --json gives every source)")
    return EXIT_OK


# -- hints -------------------------------------------------------------------------------


def cmd_hints(args: argparse.Namespace) -> int:
    _load_plugins_capturing()
    declared = registry.hints()
    engines = sorted({h.engine for _, h in declared})
    if not args.engine:
        if args.json:
            _print_json({e: [h.model_dump() | {"plugin": p} for p, h in declared if h.engine == e] for e in engines})
            return EXIT_OK
        if not engines:
            print("no plugin declares hints: install an engine plugin (e.g. kvcore-vllm); `kvcore plugins` shows what loaded")
            return EXIT_OK
        rows = [
            [e, len([1 for _, h in declared if h.engine == e]), ", ".join(sorted({p for p, h in declared if h.engine == e}))]
            for e in engines
        ]
        print(_table(rows, ["engine", "hints", "plugins"]))
        print("\n`kvcore hints ENGINE` lists an engine's hints with their meaning and accepted values")
        return EXIT_OK
    mine = [(p, h) for p, h in declared if h.engine.lower() == args.engine.lower()]
    if not mine:
        raise UsageError(
            f"no plugin declares hints for engine {args.engine!r}; engines with declared hints: {', '.join(engines) or 'none'}"
        )
    if args.json:
        _print_json([h.model_dump() | {"plugin": p} for p, h in mine])
        return EXIT_OK
    print(f"hints for engine {mine[0][1].engine!r} (kvcore.detect(..., engine={mine[0][1].engine!r}, hints={{...}})):\n")
    for p, h in mine:
        name = h.name + (f" (also {', '.join(h.aliases)})" if h.aliases else "")
        print(f"  {name}")
        print(_fill(h.meaning, width=100, initial_indent="      ", subsequent_indent="      "))
        print(_fill(f"accepts: {h.accepted()}", width=100, initial_indent="      ", subsequent_indent="          "))
        if h.default:
            print(_fill(f"default: {h.default}", width=100, initial_indent="      ", subsequent_indent="          "))
        if h.source:
            print(f"      source:  {h.source}")
        if len({q for q, _ in mine}) > 1:
            print(f"      plugin:  {p}")
    return EXIT_OK


# -- describe ----------------------------------------------------------------------------

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
        import torch

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
    t = TOKENS[tok]
    if t.literal is not None:
        return t.literal
    if tok == "NBBS":
        return sizes.get("PBS")
    if tok == "BSV":
        return sizes["BS"] * sizes["VALS"] if "BS" in sizes and "VALS" in sizes else None
    if tok == "BSS":
        return sizes["BS"] * sizes["SCALES"] if "BS" in sizes and "SCALES" in sizes else None
    return sizes.get(tok)


def cmd_describe(args: argparse.Namespace) -> int:
    import torch

    try:
        syn = parse(args.name)
    except FormatError as e:
        _err(str(e))
        return EXIT_USAGE
    dtype = _parse_dtype(args.dtype) if args.dtype else None
    sizes = _complete_sizes(syn, parse_sizes(args.sizes), dtype)
    _load_plugins_capturing()
    fmt = registry.host().formats.get(syn.name)
    axes = [{"token": t, "role": TOKENS[t].role.value, "label": TOKENS[t].label, "size": _axis_value(t, sizes)} for t in syn.axes]
    levels = [{"token": t, "role": TOKENS[t].role.value, "label": TOKENS[t].label, "size": _axis_value(t, sizes)} for t in syn.list_levels]
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
            psz = _complete_sizes(ps.syntax, plane_sizes(sizes, ps.role), dtype, f"{ps.role}.")
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
            out["dtype"] = _dtype_name(dtype)
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
        d = _format_dict(fmt)
        out.update({k: d[k] for k in ("engines", "attention_backends", "description", "sources", "plugin")})
    else:
        import difflib

        out["similar"] = difflib.get_close_matches(syn.name, list(registry.host().formats), n=3, cutoff=0.75)
    if args.json:
        _print_json(out)
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
            line += f", {out['bytes']:,} bytes ({_human_bytes(out['bytes'])}) as {out['dtype']}"
        print(line)
        if "elements_per_layer" in out:
            line = f"per layer  {out['elements_per_layer']:,} elements"
            if "bytes_per_layer" in out:
                line += f", {_human_bytes(out['bytes_per_layer'])}"
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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# -- detect --------------------------------------------------------------------------------


def _read_json(path: str) -> Any:
    """The JSON document in ``path`` (``-``: stdin). Every way it can be unreadable is a
    one-line :class:`UsageError`."""
    name = "stdin" if path == "-" else path
    try:
        if path == "-":
            raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{name} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save the description as UTF-8 JSON"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{name} is not valid JSON: {e}") from None
    except RecursionError:
        raise UsageError(f"{name} nests JSON too deeply to read; a KV cache description is a few levels of lists") from None


def _usage_hints(why: str) -> Any:
    raise UsageError(f'--hints must be a JSON object such as \'{{"kv_cache_layout": "HND"}}\' (or @file): {why}')


def _parse_hints(text: str | None) -> dict:
    if not text:
        return {}
    if text.startswith("@"):
        # the same reader as the description file: unreadable, not UTF-8, not JSON, too deep: one line
        h = _read_json(text[1:]) if text[1:] else _usage_hints("@ names no file")
    else:
        try:
            h = json.loads(text)
        except json.JSONDecodeError as e:
            _usage_hints(str(e))
        except RecursionError:
            _usage_hints("it nests too deeply")
    if not isinstance(h, dict):
        raise UsageError(f"--hints must be a JSON object, got {h!r}")
    return h


def _layout_dict(layout: Any) -> dict[str, Any]:
    d = layout.summary()
    d["engine"] = layout.engine
    d["layer_names"] = list(layout.layer_names) if layout.layer_names else None
    d["elements_per_layer"] = layout.elements_per_layer
    d["bytes_per_layer"] = layout.elements_per_layer * layout.element_size
    try:
        # the plugin that answered the detection, else the name's owner (an engine's own plugin first)
        d["plugin"] = getattr(layout, "plugin", None) or registry.format_owner(layout.format.name)
    except KeyError:
        d["plugin"] = None
    # the answering plugin's own declaration's sources (the merged format lists every declaring plugin's)
    own = registry.host().declarations.get(layout.format.name, {}).get(d["plugin"]) if d["plugin"] else None
    d["sources"] = [str(s) for s in (own.sources if own is not None and own.sources else layout.format.sources)]
    syn = layout.format.syntax
    d["head_order"] = ("HND" if syn.is_hnd else "NHD") if (syn.has("NH") and syn.has("BS")) else None
    try:
        d["shape_desc"] = layout.shape_desc().model_dump()
    except Exception as e:  # noqa: BLE001 - a plugin spec may not answer; report, don't fail
        d["shape_desc"] = f"unavailable: {e}"
    return d


def _print_layout(d: dict[str, Any], indent: str = "") -> None:
    rows = [
        ("format", d["format"] + (f"   (plugin {d['plugin']})" if d.get("plugin") else "")),
        ("shape", f"{d['symbolic']}  =  {d['concrete']}"),
        ("layers", f"{d['num_layers']}" + (f"  ({d['layer_names'][0]} .. {d['layer_names'][-1]})" if d.get("layer_names") else "")),
        ("blocks", "fused (NBBS)" if d.get("num_blocks") is None else f"{d['num_blocks']} x {d['block_size']} tokens"),
        ("slots/layer", d["page_buffer_size"]),
        (
            "heads",
            f"{d['num_heads']} x {d['head_size']} (hidden {d['hidden_dim']}), kv_size {d['kv_size']}"
            + (f", {d['head_order']}" if d.get("head_order") else ""),
        ),
        ("dtype", d["dtype"] + (f" (stored as {d['storage_dtype']})" if d["storage_dtype"] != d["dtype"] else "")),
        ("device", d["device"]),
        ("per layer", _human_bytes(d["bytes_per_layer"])),
    ]
    if d.get("note"):
        rows.append(("decided", d["note"]))
    for s in d.get("sources") or []:
        rows.append(("source", s))
    for k, v in rows:
        print(f"{indent}{k:<12} {v}")


def _leaves_device(node: Any) -> str | None:
    import torch

    while isinstance(node, (list, tuple, dict)):
        node = next(iter(node.values())) if isinstance(node, dict) else node[0]
    return node.device.type if isinstance(node, torch.Tensor) else None


def cmd_detect(args: argparse.Namespace) -> int:
    doc = _read_json(args.file)
    named = args.engine or (doc.get("engine") if isinstance(doc, dict) else None)
    if isinstance(named, str) and named:
        _check_engine(named)  # a typo'd engine is a usage error, before any tensor is built
    if args.device == "meta":
        kv_caches, engine, hints = load_tensor_description(doc, device="meta")
    else:
        # CPU storage that is never written costs address space, not memory, and gives every
        # tensor a real, distinct address (plugins tell aliased layers apart by address);
        # auto: a cache larger than this machine's address space falls back to meta tensors.
        try:
            kv_caches, engine, hints = load_tensor_description(doc, device="cpu")
        except (RuntimeError, MemoryError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if args.device == "cpu":
                raise UsageError(f"cannot reserve CPU address space for these tensors ({why}); use --device meta") from None
            _err(f"cannot reserve CPU address space for these tensors ({why}); building them on the meta device instead")
            kv_caches, engine, hints = load_tensor_description(doc, device="meta")
    if _leaves_device(kv_caches) == "meta":
        _err(
            "note: the tensors are on the meta device, where every address is 0: a plugin that compares addresses sees all layers as one memory"
        )
    engine = args.engine or engine
    if not engine:
        raise UsageError('no engine: pass --engine (vllm, sglang, ...) or put "engine" in the JSON')
    hints = {**hints, **_parse_hints(args.hints)}
    _load_plugins_capturing()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _detect_and_print(args, kv_caches, engine, hints)
        finally:
            for w in caught:  # a plugin skipped during detection: one line each, not a source-line dump
                _err(f"warning: {w.message}")


def _check_engine(engine: str) -> None:
    """Raise a one-line UsageError when no installed plugin declares ``engine`` (like
    ``kvcore formats --engine``); the Python API raises DetectionError for the same."""

    _load_plugins_capturing()
    known = known_engines()
    if engine not in known:
        raise UsageError(
            f"no installed plugin declares engine {engine!r}; engines: {', '.join(known) or 'none'} (`kvcore plugins` lists them)"
        )


def _detect_and_print(args: argparse.Namespace, kv_caches: Any, engine: str, hints: dict) -> int:
    try:
        with described_tensors():  # tensors built from a description: this process is no evidence of the engine's platform
            result = _detect_result(kv_caches, engine, hints, args.per_layer)
    except kvcore.DetectionError as e:
        if args.json:
            _print_json(
                {
                    "error": type(e).__name__,
                    "message": str(e),
                    "candidates": getattr(e, "candidates", []),
                    "hints": getattr(e, "hints", []),
                }
            )
        _err(str(e))
        return EXIT_FAIL
    except kvcore.KVCoreError as e:
        if args.json:
            _print_json({"error": type(e).__name__, "message": str(e)})
        _err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    if args.json:
        _print_json(result)
    elif args.per_layer:
        for n, g in enumerate(result["groups"]):
            print(f"group {n}: layers {g['layer_ids']}")
            _print_layout(g, indent="  ")
        if result["excluded_layers"]:
            print(f"not KV (excluded): layers {result['excluded_layers']}")
    else:
        _print_layout(result)
    return EXIT_OK


def _detect_result(kv_caches: Any, engine: str, hints: dict, per_layer: bool) -> Any:
    """What ``kvcore detect`` prints: one layout, or (``--per-layer``) its groups."""

    if not per_layer:
        return _layout_dict(kvcore.detect(kv_caches, engine, hints))
    per = kvcore.detect_per_layer(kv_caches, engine, hints=hints)
    # a mapping comes back as a mapping with its keys: report positions in its order and the names
    entries = list(per.items()) if isinstance(per, dict) else list(enumerate(per))
    groups: list[Any] = []
    excluded: list[int] = []
    excluded_names: list[str] = []
    for i, (key, lay) in enumerate(entries):
        if lay is None:
            excluded.append(i)
            if isinstance(per, dict):
                excluded_names.append(str(key))
        elif all(lay is not g for g in groups):
            groups.append(lay)
    result: dict[str, Any] = {"groups": [_layout_dict(g) for g in groups], "excluded_layers": excluded}
    if isinstance(per, dict):
        result["excluded_layer_names"] = excluded_names
    return result


# -- doctor ------------------------------------------------------------------------------


def _devices() -> list[dict[str, Any]]:
    import torch

    out: list[dict[str, Any]] = [{"type": "cpu", "count": os.cpu_count() or 1, "names": [platform.processor() or platform.machine()]}]
    try:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
            out.append({"type": "cuda", "count": n, "names": [torch.cuda.get_device_name(i) for i in range(n)], "backend": kind})
    except Exception as e:  # noqa: BLE001 - a broken driver is a finding, not a crash
        out.append({"type": "cuda", "count": 0, "error": str(e)})
    for name in ("xpu", "mps"):
        mod = getattr(torch, name, None) if name == "xpu" else getattr(torch.backends, "mps", None)
        try:
            if mod is not None and mod.is_available():
                cnt = mod.device_count() if hasattr(mod, "device_count") else 1
                out.append({"type": name, "count": cnt})
        except Exception as e:  # noqa: BLE001
            out.append({"type": name, "count": 0, "error": str(e)})
    return out


def _serving_kernel(rows: list[dict], device_type: str) -> dict[str, Any] | None:
    """The row of the kernel a transfer on ``device_type`` gets for a format no kernel claims
    specifically (``kvcore.kernels.select_kernel``, so ``KVCORE_KERNEL`` is honoured)."""

    try:
        k = select_kernel(device_type, "", device_type)
    except TransferError as e:
        return {"name": None, "why": str(e)}
    return next((r for r in rows if r["name"] == k.name), {"name": k.name, "why": k.why()})


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    plugin_warnings = _load_plugins_capturing(report=False)
    rows = kernels.kernel_report()
    devices = _devices()
    serving = {}
    for d in devices:
        k = _serving_kernel(rows, d["type"])
        specific = [r["name"] for r in rows if d["type"] in r["device_types"] and r["formats"] != "all" and r["available"]]
        serving[d["type"]] = {"kernel": k["name"], "why": k["why"], "format_specific": specific}
    # device types a registered kernel claims but no device of is present (the reference kernel
    # claims several): one row each, whichever plugins are installed or disabled
    for dt in sorted({t for r in rows for t in r["device_types"] if t != "meta"} - set(serving)):
        ks = [r["name"] for r in rows if dt in r["device_types"] and r["priority"] > 0]
        fallback = [r["name"] for r in rows if dt in r["device_types"] and r["priority"] <= 0]  # the reference kernel
        why = f"no {dt} device present; kernels for it: {', '.join(ks or fallback)}"
        serving[dt] = {"kernel": None, "why": why, "format_specific": [], "fallback": fallback if ks else []}
    compilers = {}
    for c in ("c++", "g++", "clang++", "nvcc", "hipcc", "icpx", "ninja"):
        p = shutil.which(c)
        if p is None and c == "nvcc" and os.environ.get("CUDA_HOME"):
            cand = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
            p = cand if os.path.exists(cand) else None
        compilers[c] = p
    env = {k: v for k, v in os.environ.items() if k.startswith("KVCORE_")}
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "kvcore": kvcore.__version__,
        "torch": torch.__version__,
        "torch_cuda": getattr(torch.version, "cuda", None),
        "devices": devices,
        "plugins": [i.as_dict() for i in kvcore.plugins()],
        "plugin_warnings": plugin_warnings,
        "disabled_plugins": registry.disabled_plugins(),
        "kernels": rows,
        "serving": serving,
        "compilers": compilers,
        "env": env,
    }
    if args.json:
        _print_json(report)
        return EXIT_OK
    print(f"python     {report['python']}  ({report['platform']})")
    print(f"kvcore     {report['kvcore']}")
    print(f"torch      {report['torch']}" + (f"  (CUDA {report['torch_cuda']})" if report["torch_cuda"] else ""))
    # long lines wrap at 100 columns under their label; a path or a command is never broken
    col = " " * 11
    dev_text = "; ".join(f"{d['type']} x{d['count']}" + (f" ({', '.join(d['names'])})" if d.get("names") else "") for d in devices)
    print(_fill(dev_text, initial_indent="devices    ", subsequent_indent=col))
    ok = [i for i in kvcore.plugins() if not i.error]
    bad = [i for i in kvcore.plugins() if i.error]
    print(_fill(", ".join(f"{i.name} {i.version or ''}".strip() for i in ok), initial_indent="plugins    ", subsequent_indent=col))
    for i in bad:
        print(_fill(f"{i.name}: {i.error}", initial_indent="  FAILED   ", subsequent_indent=col))
    off = registry.disabled_plugins()
    if off:
        print(
            _fill(
                f"{', '.join(off)} (KVCORE_DISABLE_PLUGINS / kvcore.disable_plugins: not loaded)",
                initial_indent="disabled   ",
                subsequent_indent=col,
            )
        )
    print("\nkernels")
    table = _table(
        [
            [
                r["name"],
                ",".join(r["device_types"]),
                r["formats"] if r["formats"] == "all" else len(r["formats"]),
                r["priority"],
                "yes" if r["available"] else "no",
            ]
            for r in rows
        ],
        ["name", "devices", "formats", "priority", "available"],
    )
    print(textwrap.indent(table, "  "))
    for r in rows:
        print(_fill(f"{r['name']}: {r['why']}", width=100, initial_indent="  ", subsequent_indent="      "))
    print("\nserving (the kernel a transfer on each device type gets, for any format)")
    for dev, sv in serving.items():
        extra = f"; format-specific kernels: {', '.join(sv['format_specific'])}" if sv["format_specific"] else ""
        if sv.get("fallback"):
            extra += f"; also {', '.join(sv['fallback'])} (the fallback for any device)"
        print(_fill(f"{sv['kernel'] or '- (' + sv['why'] + ')'}{extra}", initial_indent=f"  {dev:<6} ", subsequent_indent=" " * 9))
    print()
    print(
        _fill(", ".join(f"{c}={'yes' if p else 'no'}" for c, p in compilers.items()), initial_indent="compilers  ", subsequent_indent=col)
    )
    if env:
        print(_fill(" ".join(f"{k}={v}" for k, v in env.items()), initial_indent="env        ", subsequent_indent=col))
    return EXIT_OK


# -- demo, bench, check: dispatch ---------------------------------------------------------


def _demo_listing(demos: dict) -> str:
    if not demos:
        return "  (none: install an engine plugin that registers one, e.g. kvcore-vllm)"
    return "\n".join(f"  {n:<12} {h or ''}  [plugin {p}]" for n, (_, h, p) in sorted(demos.items()))


def run_demo(argv: list[str]) -> int:
    """``kvcore demo [--engine NAME] [--list] [DEMO ARGS...]``: everything except
    ``--engine``/``--list`` goes to the demo's own ``run(argv)``."""

    p = OneLineParser(prog="kvcore demo", add_help=False)
    p.add_argument("--engine", default=None)
    p.add_argument("--list", action="store_true")
    try:
        ns, rest = p.parse_known_args(argv)
    except SystemExit as e:  # "--engine" without a value
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    _load_plugins_capturing()
    demos = registry.demos()
    if ns.list or (ns.engine is None and any(a in ("-h", "--help") for a in rest)):
        print(DEMO_HELP)
        print("\nregistered demos:\n" + _demo_listing(demos))
        return EXIT_OK
    engine = ns.engine or "vllm"
    if engine not in demos:
        _err(f"no demo named {engine!r} is registered. Registered demos:\n{_demo_listing(demos)}")
        return EXIT_USAGE
    run, _, plugin = demos[engine]
    try:
        rc = run(list(rest))
    except SystemExit as e:  # the demo's own argparse
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    return int(rc or 0)


def _optional_module(name: str) -> Any:
    """Import an optional command module; ``None`` when it is absent (not when it is broken)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name or (e.name and name.startswith(e.name + ".")):
            return None
        raise


_DISPATCH = {
    "bench": ("kvcore.bench", "transfer benchmarks"),
    "check": ("kvcore.testing.check", "the conformance suite"),
}


_DISPATCH_EXAMPLES = {
    "bench": (
        "kvcore bench --device cpu --quick",
        "kvcore bench --device cuda --json --output bench.json",
    ),
    "check": ("kvcore check", "kvcore check vllm -q", "kvcore check trtllm --json"),
}


# -- the parser --------------------------------------------------------------------------

DEMO_HELP = """\
usage: kvcore demo [--engine NAME] [--list] [-h] [DEMO ARGS ...]

Run a plugin's end-to-end demo: allocate an engine's KV cache exactly as the engine does,
fill it with values that encode (layer, K/V, token, head, element), detect it, offload
requests by slot mapping, restore them into other blocks, verify bit-exact and semantically,
and print a table with the transfer speed. Exit 1 on any mismatch.

options:
  --engine NAME   which registered demo to run (default: vllm)
  --list          list the registered demos
  -h, --help      show this help (a demo's own options: kvcore demo --engine NAME --help)
  ...             everything else goes to the demo

examples:
  kvcore demo                                      # vLLM: Llama-3-8B NHD/HND and DeepSeek-V3 MLA
  kvcore demo --engine vllm --json --num-blocks 64
  kvcore demo --engine vllm --pd                   # prefill/decode between two processes
  kvcore demo --engine sglang
  kvcore demo --engine vllm --help                 # the vLLM demo's own options
  kvcore demo --list"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvcore`` parser. ``command``: the subcommand about to run; only then are the
    optional modules (bench, check) imported to add their arguments."""
    top = OneLineParser(
        prog="kvcore",
        formatter_class=_Formatter,
        description=(
            "kvcore: know how every LLM serving engine lays out its KV cache, and move it fast.\n"
            "A layout's name is its shape template (NL_X_TWO_NB_BS_NH_HS = NL x [2, NB, BS, NH, HS]);\n"
            "engines and devices are plugins."
        ),
        epilog=(
            "examples:\n"
            "  kvcore formats --engine vllm\n"
            "  kvcore describe NL_X_TWO_NB_NH_BS_HS --sizes NL=32,NB=2048,BS=16,NH=8,HS=128\n"
            '  kvcore detect cache.json --engine vllm --hints \'{"kv_cache_layout": "HND"}\'\n'
            "  kvcore demo\n\n"
            "exit codes: 0 ok, 1 failure (not recognised, mismatch), 2 usage error"
        ),
    )
    top.add_argument("--version", action="version", version=f"kvcore {_version()}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "plugins",
        help="what loaded, from which distribution, and what each registered",
        formatter_class=_Formatter,
        description="List kvcore plugins: the distribution and version each came from, the formats, kernels and hooks it "
        "registered, and plugins that failed to load with their error.",
        epilog="examples:\n  kvcore plugins\n  kvcore plugins --json | jq '.[] | select(.error)'\n  KVCORE_DISABLE_PLUGINS=sglang kvcore plugins",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-v", "--verbose", action="store_true", help="also list each plugin's formats")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser(
        "formats",
        help="every registered layout: shape, facts, engines, source, plugin",
        formatter_class=_Formatter,
        description="Table of the registered formats: name, symbolic shape, kv_size, derived facts (container, MLA, "
        "HND/NHD, fused K/V, fused NBBS, K/V-major), the engines and attention backends that allocate it, where that "
        "fact comes from (engine version file), and the plugin that registers it.",
        epilog="examples:\n  kvcore formats\n  kvcore formats --engine vllm\n  kvcore formats --json",
    )
    p.add_argument("--engine", help="only the formats this engine's detector can return (declared for it, or by its fixtures)")
    p.add_argument("--wide", action="store_true", help="do not clip the engines and source columns")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_formats)

    p = sub.add_parser(
        "hints",
        help="the hints an engine's plugins read: meaning, accepted values, default",
        formatter_class=_Formatter,
        description="List the hints kvcore.detect(..., engine=ENGINE, hints={...}) understands, as the engine's plugins "
        "declare them (kvcore_register_hints): each hint's meaning, accepted values or type, aliases, default and the engine "
        "source that defines it. Without ENGINE: the engines that declare hints.",
        epilog="examples:\n  kvcore hints\n  kvcore hints vllm\n  kvcore hints sglang --json\n\nan engine no plugin declares hints for exits 2",
    )
    p.add_argument("engine", nargs="?", help="engine name (vllm, sglang, transformers, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_hints)

    p = sub.add_parser(
        "describe",
        help="parse any layout name; render symbolic and concrete shapes",
        formatter_class=_Formatter,
        description="Parse a format name (registered or not) in kvcore's layout grammar and print its symbolic shape, its "
        "concrete shape for --sizes, its axes and derived facts, and, if a plugin registers it, its sources. Tokens: NL "
        "layers, NB blocks, BS block size, NBBS fused blocks*tokens (PBS), NH KV heads, HS head size, HSC/HSE a head's "
        "elements split in chunks, BSC/BSE a block's tokens split in groups, CS packed K|V (2*HS), TWO / ONE literal axes, "
        "NP planes, BSV/BSS blocked-scale records; '_' separates axes, '_X_' a list level, ROLE=TEMPLATE+... planes.",
        epilog=(
            "examples:\n"
            "  kvcore describe NL_X_TWO_NB_BS_NH_HS --sizes NL=32,NB=2048,BS=16,NH=8,HS=128 --dtype bfloat16\n"
            "  # split K (ROCm paged attention): HSE = 16 bytes / 2 = 8 elements from --dtype, HSC = 128 / 8 = 16\n"
            "  kvcore describe K=NL_X_NB_NH_HSC_BS_HSE+V=NL_X_NB_NH_HS_BS --sizes NL=32,NB=2048,BS=16,NH=8,HS=128 --dtype bfloat16\n"
            "  kvcore describe NL_X_NB_NH_BSC_HS_BSE --sizes NL=32,NB=2048,BS=16,NH=8,HS=128,BSE=4\n"
            "  kvcore describe TWO_X_NL_X_NBBS_NH_HS --sizes NL=32,PBS=65536,NH=8,HS=128\n"
            "  kvcore describe NL_X_NB_BS_HS --json\n\n"
            "a malformed name prints the grammar error and exits 2"
        ),
    )
    p.add_argument("name", help="a format name, e.g. NL_X_TWO_NB_BS_NH_HS")
    p.add_argument(
        "--sizes",
        help="comma-separated sizes: NL, NB, BS, PBS (NBBS), NH, HS, HSC, HSE, BSC, BSE, CS, NP, VALS, SCALES, or ROLE.KEY for "
        "one plane of a multi-plane name (K.HS=192); derived when omitted: PBS = NB*BS, CS = 2*HS, HSE = 16 bytes / element "
        "size with --dtype (vLLM's x), HSC = HS/HSE, BSC = BS/BSE",
    )
    p.add_argument("--dtype", help="element dtype to compute bytes (bfloat16, float16, float8_e4m3fn, uint8, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser(
        "detect",
        help="detect the layout of a cache described in JSON (shapes, strides, dtypes)",
        formatter_class=_Formatter,
        description=(
            "Detect a KV cache you only know from a log: describe its tensors in JSON and kvcore builds them without\n"
            "writing any memory (see --device), asks the engine's plugin, and prints the layout or why it cannot decide.\n\n"
            'JSON: {"engine": "vllm", "hints": {...}, "dtype": "bfloat16", "kv_caches": NODE}, or a bare NODE.\n'
            'NODE: a tensor {"shape": [...], "stride": [...], "dtype": ..., "storage_offset": 0}, a list of NODEs,\n'
            'or a mapping layer-name -> NODE. "repeat": N on a tensor means N identical layers (in a mapping, the\n'
            'name must contain {i}); {"repeat": N, "of": NODE} repeats any node. Tensors that name the same\n'
            '"storage" are views of one buffer ("storage_offset_step" advances the offset per repeat). stride defaults\n'
            "to contiguous; strides and offsets count elements of the tensor's dtype."
        ),
        epilog=(
            "example (vLLM FlashAttention, Llama-3-8B, HND allocated and exposed as NHD):\n"
            "  cat > cache.json <<'EOF'\n"
            '  {"engine": "vllm", "dtype": "bfloat16",\n'
            '   "kv_caches": {"model.layers.{i}.self_attn.attn":\n'
            '     {"shape": [2, 2048, 16, 8, 128], "stride": [33554432, 16384, 128, 2048, 1], "repeat": 32}}}\n'
            "  EOF\n"
            "  kvcore detect cache.json\n"
            '  kvcore detect - --engine vllm --hints \'{"attention_backend": "FLASH_ATTN"}\' --json < cache.json\n\n'
            "exit 1 when no plugin recognises the cache or two layouts fit (the message names the deciding hint)"
        ),
    )
    p.add_argument("file", help="JSON file, or - for stdin")
    p.add_argument("--engine", help='engine name (overrides the file\'s "engine")')
    p.add_argument("--hints", help='JSON object of hints, or @file (merged over the file\'s "hints")')
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "meta"],
        help="where to build the tensors: cpu reserves the minimal storage but never writes it (address space, not "
        "memory); meta allocates nothing, but every meta tensor has address 0, so layers sharing memory cannot be told "
        "from layers that do not; auto (default): cpu, or meta when the address space is not there",
    )
    p.add_argument("--per-layer", action="store_true", help="hybrid models: detect each group of like layers (detect_per_layer)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_detect)

    p = sub.add_parser(
        "doctor",
        help="versions, devices, plugins, which kernel serves each device and why, compilers",
        formatter_class=_Formatter,
        description="Report the environment kvcore runs in: Python and torch versions, devices present, plugins (and "
        "failures), every transfer kernel with whether it is available and why, which kernel serves each device type, "
        "and the compilers found for native kernels.",
        epilog="examples:\n  kvcore doctor\n  kvcore doctor --json",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)

    sub.add_parser(
        "demo",
        help="run a plugin's end-to-end demo (default: vllm)",
        add_help=False,
        formatter_class=_Formatter,
        description=DEMO_HELP,
    )

    for name, (module, what) in _DISPATCH.items():
        p = sub.add_parser(
            name,
            help=f"{what} ({module})",
            formatter_class=_Formatter,
            description=f"Dispatches to {module}; `kvcore {name} --help` lists its options when it is installed.",
            epilog="examples:\n" + "\n".join(f"  {e}" for e in _DISPATCH_EXAMPLES[name]),
        )
        p.set_defaults(func=None, module=module)
        if command == name:
            mod = _optional_module(module)
            if mod is None:
                p.set_defaults(missing=True)
            else:
                mod.add_arguments(p)
                if p.description and "\n" not in p.description:  # a module's one-paragraph description
                    p.description = _fill(p.description, width=100)
                p.set_defaults(func=mod.run, missing=False)
    return top


def _version() -> str:
    return getattr(kvcore, "__version__", "unknown")


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "demo":
        return run_demo(argv[1:])
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command in _DISPATCH:
        module = _DISPATCH[command][0]
        if _optional_module(module) is None:
            _err(f"`kvcore {command}` needs {module}, which is not installed in this kvcore build")
            return EXIT_USAGE
    parser = build_parser(command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_USAGE)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:  # pragma: no cover - guarded above
        _err(f"`kvcore {args.command}` is not available")
        return EXIT_USAGE
    return int(func(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvcore`` console script. Returns the exit code."""

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except KVCoreError as e:
        _err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:  # `kvcore formats | head`: stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - report, don't dump a traceback on users
        if os.environ.get("KVCORE_DEBUG"):
            traceback.print_exc()
        else:
            _err(f"internal error: {type(e).__name__}: {e} (set KVCORE_DEBUG=1 for the traceback, and please report it)")
        return EXIT_FAIL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
