"""The engine's KV cache as kvrail moves it: from each layer's tensor (its shape and strides,
as vLLM's attention backend made it, never assumed) to kvrail's layout — blocks, the bytes
of a block, how far apart blocks lie, how a block's bytes are ordered — and to the
registrations that cover every layer once.

The tensors vLLM hands a connector (``register_kv_caches``):

* vLLM 0.32: one view per layer, logical ``[B, H, N, C]`` (blocks, KV heads, tokens, K and
  V together in C), laid out in memory by the resolved ``KVCacheLayout``: LBHNC (the CPU
  backend's, and what kvrail asks for), LBNHC, BLHNC / BLNHC (a block of every layer
  together: blocks of one layer lie a page per layer apart), LHBNC / BHLNC (heads outside
  the blocks).
* older vLLMs: ``[2, B, N, H, D]`` (FlashAttention; its HND variant permutes the strides),
  ``[B, 2, N, H, D]`` (FlashInfer), ``[B, N, C]`` (MLA: no K/V axis, one head).

A layout kvrail cannot describe (a block whose bytes are not one dense run, heads outside
the blocks and inside another axis) fails at start, naming the layer, its shape and strides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._kvrail import MisuseError


@dataclass(frozen=True)
class Geometry:
    """One layer's KV cache, in bytes."""

    addr: int
    extent: int  # from the first block's first byte to the last block's last
    num_blocks: int
    block_bytes: int  # one block of one plane: a dense run
    block_stride: int  # from a block to the next in a plane
    planes: int  # planes lie num_blocks × block_stride apart
    block_size: int  # tokens a block
    kv_heads: int  # heads inside a block (1 when heads are planes, or MLA)
    inner: str  # "HND", "NHD" or "packed"
    kind: str  # "DRAM" or "VRAM"
    device: int

    def shape_key(self) -> Tuple[int, ...]:
        """What every layer must share to be one kvrail layout."""
        return (
            self.extent,
            self.num_blocks,
            self.block_bytes,
            self.block_stride,
            self.planes,
            self.block_size,
            self.kv_heads,
        )


def _tensor_facts(t: Any) -> Tuple[Tuple[int, ...], Tuple[int, ...], int, int, str, int]:
    """(shape, strides in bytes, element size, first byte's address, kind, device)."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):
        elem = int(t.element_size())
        shape = tuple(int(x) for x in t.shape)
        if hasattr(t, "stride"):
            strides = tuple(int(x) * elem for x in t.stride())
        elif getattr(t, "is_contiguous", lambda: False)():
            # a device tensor that says only that it is contiguous
            acc, out = elem, []
            for x in reversed(shape):
                out.append(acc)
                acc *= x
            strides = tuple(reversed(out))
        else:
            raise MisuseError(f"kv cache: {type(t).__name__} gives neither strides nor contiguity")
        dev = getattr(t, "device", None)
        kind = "DRAM" if dev is None or getattr(dev, "type", "cpu") == "cpu" else "VRAM"
        return shape, strides, elem, int(t.data_ptr()), kind, int(getattr(dev, "index", None) or 0)
    ai = getattr(t, "__array_interface__", None)
    if ai is not None:
        shape = tuple(int(x) for x in t.shape)
        elem = int(t.itemsize)
        strides = tuple(int(x) for x in t.strides)
        return shape, strides, elem, int(ai["data"][0]), "DRAM", 0
    raise MisuseError(f"kv cache: {type(t).__name__} is neither a tensor nor an array")


def _axes(shape: Tuple[int, ...], hints: Dict[str, int]) -> Tuple[str, ...]:
    """Each axis's meaning: B blocks, P K/V planes, H heads, N tokens, C a token's bytes."""
    n = len(shape)
    if n == 4:
        return ("B", "H", "N", "C")
    if n == 3:
        return ("B", "N", "C")
    if n == 5:
        if shape[0] == 2:
            axes = ["P", "B", "N", "H", "C"]
        elif shape[1] == 2:
            axes = ["B", "P", "N", "H", "C"]
        else:
            raise MisuseError(f"shape {shape}: five axes without a K/V axis of 2")
        # the heads and tokens of a block: N then H, unless the sizes say H then N
        heads, tokens = hints.get("kv_heads"), hints.get("block_size")
        says_hn = (tokens and shape[3] == tokens and shape[2] != tokens) or (
            heads and shape[2] == heads and shape[3] != heads
        )
        if says_hn:
            axes[2], axes[3] = "H", "N"
        return tuple(axes)
    raise MisuseError(f"shape {shape}: not a KV cache kvrail knows (3, 4 or 5 axes)")


def layer_geometry(name: str, t: Any, hints: Optional[Dict[str, int]] = None) -> Geometry:
    """Layer ``name``'s tensor ``t`` as kvrail sees it; ``hints`` (``kv_heads``,
    ``block_size``) only tell apart axes of a legacy shape whose sizes could be either."""
    shape, strides, elem, addr, kind, dev = _tensor_facts(t)
    where = f"kv_caches[{name!r}]: shape {shape}, strides {strides} bytes"
    try:
        axes = _axes(shape, hints or {})
    except MisuseError as e:
        raise MisuseError(f"kv_caches[{name!r}]: {e}") from None
    size = dict(zip(axes, shape))
    stride = dict(zip(axes, strides))
    nb, sb = size["B"], stride["B"]
    rest = [a for a in axes if a != "B" and size[a] > 1]
    outer = [a for a in rest if stride[a] > sb]
    inner = sorted((a for a in rest if a not in outer), key=lambda a: -stride[a])
    # a block of a plane: one dense run of bytes
    run = elem
    for a in reversed(inner):
        if stride[a] != run:
            raise MisuseError(f"{where}: a block's bytes are not one run (axis {a})")
        run *= size[a]
    unit = run
    if sb < unit:
        raise MisuseError(f"{where}: blocks overlap")
    planes = 1
    if outer:
        if len(outer) > 1:
            raise MisuseError(f"{where}: axes {outer} both lie outside the blocks")
        p = outer[0]
        if stride[p] != nb * sb:
            raise MisuseError(
                f"{where}: axis {p} lies outside the blocks but not outside all of them "
                f"(stride {stride[p]}, blocks span {nb * sb})"
            )
        planes = size[p]
    if "P" in inner:
        order = "packed"
    elif "H" in inner and "N" in inner:
        order = "HND" if stride["H"] > stride["N"] else "NHD"
    else:
        order = "HND"  # one head a block (or one token): both orders agree
    heads = size.get("H", 1) if "H" in inner else 1
    tokens = size.get("N", 1)
    if unit % (heads * tokens) != 0:
        raise MisuseError(f"{where}: {unit} bytes a block are not {heads} heads × {tokens} tokens")
    extent = (planes * nb - 1) * sb + unit
    return Geometry(addr, extent, nb, unit, sb, planes, tokens, heads, order, kind, dev)


def describe(
    kv_caches: Dict[str, Any], hints: Optional[Dict[str, int]] = None, tokens_in_order: bool = True
) -> Tuple[Dict[str, Any], List[Tuple[int, int, str, int, List[str], Optional[List[int]], int]]]:
    """kvrail's layout (JSON-ready) for every layer of ``kv_caches``, and the registrations
    covering them: each run of layers whose memory touches or overlaps (one allocation:
    back to back, or interleaved block by block) is one pooled registration.

    ``tokens_in_order`` False: the attention kernel keeps a block's tokens in an order of its
    own behind the logical view (vLLM's CPU backend: a head's keys, then its values, in
    rows its ISA chooses), so heads can be told apart but tokens cannot: whole blocks (or
    whole heads of them) move, and chunk_mode / swa_window_mode are refused."""
    if not kv_caches:
        raise MisuseError("kv_caches: empty")
    names = list(kv_caches)
    geo = {n: layer_geometry(n, kv_caches[n], hints) for n in names}
    first = geo[names[0]]
    for n in names[1:]:
        if geo[n].shape_key() != first.shape_key() or geo[n].inner != first.inner:
            raise MisuseError(
                f"kv_caches[{n!r}]: its layout ({geo[n]}) differs from "
                f"{names[0]!r}'s ({first}): kvrail moves layers of one layout"
            )
    layout = {
        "layers": names,
        "num_blocks": first.num_blocks,
        "block_bytes": first.block_bytes,
        "planes": first.planes,
        "block_size": first.block_size,
        "kv_heads": first.kv_heads,
        "block_stride": 0 if first.block_stride == first.block_bytes else first.block_stride,
        "inner": first.inner,
    }
    if not tokens_in_order:
        layout["inner"] = "heads" if first.inner == "HND" else "packed"
    # runs of layers whose spans touch or overlap: one registration each
    order = sorted(names, key=lambda n: geo[n].addr)
    caches = []
    run: List[str] = []
    end = 0
    for n in order + [None]:
        g = geo[n] if n is not None else None
        if g is not None and run and g.addr <= end and g.kind == geo[run[0]].kind:
            run.append(n)
            end = max(end, g.addr + g.extent)
            continue
        if run:
            g0 = geo[run[0]]
            if len(run) == 1:
                caches.append((g0.addr, g0.extent, g0.kind, g0.device, run, None, g0.extent))
            else:
                offs = [geo[m].addr - g0.addr for m in run]
                caches.append((g0.addr, end - g0.addr, g0.kind, g0.device, run, offs, g0.extent))
        if g is not None:
            run, end = [n], g.addr + g.extent
    return layout, caches


def block_bytes_of(t: Any, layout: Dict[str, Any], plane: int, block: int) -> Tuple[int, int]:
    """(address, length) of ``block`` of ``plane`` of a layer whose tensor is ``t``: what
    the connector moves for it (tests compare it with the tensor's own indexing)."""
    _, _, _, addr, _, _ = _tensor_facts(t)
    stride = layout["block_stride"] or layout["block_bytes"]
    return addr + (plane * layout["num_blocks"] + block) * stride, layout["block_bytes"]


def prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out
