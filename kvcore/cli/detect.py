"""``kvcore detect``: the layout of a cache known only from a log, described in JSON
(shapes, strides, dtypes), built without writing memory and asked of the engine's plugin."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

import torch

import kvcore
from kvcore import detection, dtypes, registry
from kvcore.cli.output import EXIT_FAIL, EXIT_OK, add_json_flag, err, human_bytes, print_json
from kvcore.cli.plugins import load_plugins_capturing
from kvcore.tensor_description import UsageError, load_tensor_description

#: ``kvcore --help``'s line for the command, and its own help's text above and below the options
HELP = "detect the layout of a cache described in JSON (shapes, strides, dtypes)"
DESCRIPTION = (
    "Detect a KV cache you only know from a log: describe its tensors in JSON and kvcore builds them without\n"
    "writing any memory (see --device), asks the engine's plugin, and prints the layout or why it cannot decide.\n\n"
    'JSON: {"engine": "vllm", "hints": {...}, "dtype": "bfloat16", "kv_caches": NODE}, or a bare NODE.\n'
    'NODE: a tensor {"shape": [...], "stride": [...], "dtype": ..., "storage_offset": 0}, a list of NODEs,\n'
    'or a mapping layer-name -> NODE. "repeat": N on a tensor means N identical layers (in a mapping, the\n'
    'name must contain {i}); {"repeat": N, "of": NODE} repeats any node. Tensors that name the same\n'
    '"storage" are views of one buffer ("storage_offset_step" advances the offset per repeat). stride defaults\n'
    "to contiguous; strides and offsets count elements of the tensor's dtype."
)
EPILOG = (
    "example (vLLM FlashAttention, Llama-3-8B, HND allocated and exposed as NHD):\n"
    "  cat > cache.json <<'EOF'\n"
    '  {"engine": "vllm", "dtype": "bfloat16",\n'
    '   "kv_caches": {"model.layers.{i}.self_attn.attn":\n'
    '     {"shape": [2, 2048, 16, 8, 128], "stride": [33554432, 16384, 128, 2048, 1], "repeat": 32}}}\n'
    "  EOF\n"
    "  kvcore detect cache.json\n"
    '  kvcore detect - --engine vllm --hints \'{"attention_backend": "FLASH_ATTN"}\' --json < cache.json\n\n'
    "exit 1 when no plugin recognises the cache or two layouts fit (the message names the deciding hint)"
)


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
        ("per layer", human_bytes(d["bytes_per_layer"])),
    ]
    if d.get("note"):
        rows.append(("decided", d["note"]))
    for s in d.get("sources") or []:
        rows.append(("source", s))
    for k, v in rows:
        print(f"{indent}{k:<12} {v}")


def _leaves_device(node: Any) -> str | None:
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
            err(f"cannot reserve CPU address space for these tensors ({why}); building them on the meta device instead")
            kv_caches, engine, hints = load_tensor_description(doc, device="meta")
    if _leaves_device(kv_caches) == "meta":
        err(
            "note: the tensors are on the meta device, where every address is 0: a plugin that compares addresses sees all layers as one memory"
        )
    engine = args.engine or engine
    if not engine:
        raise UsageError('no engine: pass --engine (vllm, sglang, ...) or put "engine" in the JSON')
    hints = {**hints, **_parse_hints(args.hints)}
    load_plugins_capturing()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _detect_and_print(args, kv_caches, engine, hints)
        finally:
            for w in caught:  # a plugin skipped during detection: one line each, not a source-line dump
                err(f"warning: {w.message}")


def _check_engine(engine: str) -> None:
    """Raise a one-line UsageError when no installed plugin declares ``engine`` (like
    ``kvcore formats --engine``); the Python API raises DetectionError for the same."""

    load_plugins_capturing()
    known = detection.known_engines()
    if engine not in known:
        raise UsageError(
            f"no installed plugin declares engine {engine!r}; engines: {', '.join(known) or 'none'} (`kvcore plugins` lists them)"
        )


def _detect_and_print(args: argparse.Namespace, kv_caches: Any, engine: str, hints: dict) -> int:
    try:
        with dtypes.described_tensors():  # tensors built from a description: this process is no evidence of the engine's platform
            result = _detect_result(kv_caches, engine, hints, args.per_layer)
    except kvcore.DetectionError as e:
        if args.json:
            print_json(
                {
                    "error": type(e).__name__,
                    "message": str(e),
                    "candidates": getattr(e, "candidates", []),
                    "hints": getattr(e, "hints", []),
                }
            )
        err(str(e))
        return EXIT_FAIL
    except kvcore.KVCoreError as e:
        if args.json:
            print_json({"error": type(e).__name__, "message": str(e)})
        err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    if args.json:
        print_json(result)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    add_json_flag(p)
