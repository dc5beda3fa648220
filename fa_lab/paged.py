"""Paged KV caches: ``block_table``, ``seqlen_k`` and ``kv_cache_layout`` as upstream takes them.

Upstream (ROCm/FlyDSL ``main`` 11c4174d, kernels/attention/flash_attn_interface.py
l.372-601, the ``_flydsl_flash_attn_paged`` path of ``flydsl_flash_attn_func``) reads K
and V from a physical page cache through a vLLM-style block table. What that path does,
decision for decision, and what fa_lab models of it:

* **layouts and pages** (l.413-468): ``kv_cache_layout`` ``"linear"``: K and V
  ``[NumBlocks, PageSize, Hkv, D]``; ``"vectorized"`` (aiter's 5-D): K ``[NumBlocks, Hkv,
  D/kVS, PageSize, kVS]``, V ``[NumBlocks, Hkv, PageSize/kVS, D, kVS]`` with kVS = 16 /
  element size (8 for bf16/f16). The page size is 64 only (``_PAGED_PAGE_SIZE``, l.375):
  one page is one 64-column KV tile. ``"linear3d"`` is named in the docstring (l.716) but
  the paged path refuses it (l.413-417), so fa_lab refuses it too, naming the argument.
* **the length the kernel sees** (l.486-488, l.592-593): a dense (non-varlen) paged call
  hands the kernel one KV length for the whole batch, ``max(seqlen_k)`` (``max_seqlen_kv``
  when given). ``seqlen_k`` itself never reaches the kernel: a batch whose ``seqlen_k[b]``
  is shorter attends to the keys its block table maps up to that maximum. fa_lab models
  this and warns (``RaggedSeqlenWarning``).
* **which pages it reads** (flash_attn_utils.py ``DualwavePageIdLoader.
  load_block_table_to_lds``, l.3608-3637): the kernel walks N tiles (ceil(Skv/64), cut
  at the causal diagonal, rounded up to even, at least 4; l.3540-3554) and caches one page
  id per tile in LDS: ``block_table[b, t]`` for t < ceil(Skv/64), and 0 for the padding
  tiles past it (the LDS slot is zeroed first, l.3628-3629). So entries past
  ceil(Skv/64) are never read, but the padding tiles read physical page 0.
* **what it reads of a page** (``init_descriptors``, l.3428-3434 and ``_make_page_view``
  l.560-572): a page's buffer descriptor spans the whole page, so the rows of the last,
  partly filled page past Skv, and all of page 0 on a padding tile, are loaded as they are
  in memory (a dense call's out-of-bounds rows read 0 instead). Their scores are replaced
  by -inf with a select (``seq_pad_mask_inplace``, l.3940-3947), so a NaN in K there never
  shows; but their V rows enter P V with P = 0, and 0 * NaN (or 0 * inf) is NaN, so a
  non-finite V there reaches the output (docs/semantics.md, paged KV).

Not modelled: the bf16/f16 varlen paged build (``cu_seqlens_q`` with a page table),
upstream's routing of short paged calls (Sq <= 256) to the generic "light" paged kernel
(fa_lab runs them on DUALWAVE_SWP, as it does short varlen calls). The fp8 kernel refuses
paged KV at ``main-11c4174d`` (l.807-809).

**Paged fp8 prefill** (FlyDSL #1066, ROCm/FlyDSL 6aeb4321,
``_flydsl_flash_attn_paged`` in flash_attn_interface.py and
``build_flash_attn_paged_fp8_module`` in flash_attn_fp8_paged_gfx950.py) takes another
call: packed varlen fp8 q ``[total_q, H, D]`` with ``cu_seqlens_q``, ``cu_seqlens_kv``
and ``max_seqlen_q``, a causal (bottom-right) mask, the vectorized page-64 cache only,
and descales of one fp32 element each. ``check_fp8`` checks it into a ``PagedFp8``: the
per-sequence KV lengths come from ``cu_seqlens_kv`` (the kernel's sequence lengths);
``seqlen_k`` must agree with them (upstream reads it only for max(seqlen_k)), and fa_lab
refuses a call where they differ rather than guess. The interface picks one of two
kernels of the same builder by ``use_bn128``: (128, 128) head dims with an even number of
pages of ``max_seqlen_kv`` (else max(seqlen_k)) run on the paired-page BN128 kernel
(``schedule="bn128"``, ``fa_lab.kernels.swp_fp8.paged``); every other call, (192, 128),
(192, 192), an odd page count or one page, runs on the per-tile kernel
(``schedule="tile"``, ``fa_lab.kernels.swp_fp8.paged_tile``). They read pages
differently:

* BN128 loads page ids two at a time, for a pair of 64-key tiles
  (``DualwaveFp8KernelContext.load_page_id_pair``): a pair that starts inside the
  sequence's pages reads that entry and the next one, and a pair past them reads the
  row's first two entries. So each row's first max(2, its page count rounded up to even)
  entries are read and must name pages of the cache.
* The per-tile kernel loads one id per tile (``load_page_id``): entry t of the row while
  t < ceil(seqlen_k[b] / 64), else entry 0 of the whole flat table, ``block_table[0, 0]``.
  So each row's own pages are read, and the first row's first entry by every padding tile.

For one sequence the interface builds the BN128 kernel without varlen
(``paged_bn128_varlen`` needs B > 1): it then takes ``max_seqlen_q`` and the KV length
as the sequence's lengths and stores every row up to ``max_seqlen_q``, so ``check_fp8``
refuses a one-sequence BN128 call where they differ from ``cu_seqlens``.

Either way the rows of those pages past seqlen_k are masked in S but enter P V with P = 0.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from fa_lab.checks import caller_stacklevel
from fa_lab.varlen import cu_seqlens

#: ``_PAGED_PAGE_SIZE`` (l.375): the one page size the paged DUALWAVE_SWP build takes.
PAGE_SIZES = (64,)
#: ``kv_cache_layout`` values the paged path runs; ``"linear3d"`` is documented upstream
#: but refused by this path (l.413-417).
LAYOUTS = ("linear", "vectorized")
#: ``_PAGED_BT_LDS_SIZE`` (l.376): page ids the kernel caches in LDS per (split of a) row.
BT_LDS_SIZE = 2048
_INT_DTYPES = (torch.int32, torch.int64)


class RaggedSeqlenWarning(UserWarning):
    """A dense paged call with unequal ``seqlen_k``: upstream's kernel runs every batch
    to ``max(seqlen_k)``, so shorter sequences attend past their own length."""


def vector_size(dtype: torch.dtype) -> int:
    """kVS = 16 bytes / element size: the vectorized layout's innermost dimension."""
    return 16 // torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PagedKV:
    """A checked paged call: the block table (int32, on the cache's device), the host-side
    ``seqlen_k`` list, the layout and page size, ``seqlen_kv``, the one KV length the
    kernel sees (``max(seqlen_k)``), and the cache's block and kv-head counts."""

    block_table: torch.Tensor
    seqlen_k: tuple
    layout: str
    page_size: int
    seqlen_kv: int
    num_blocks: int
    num_kv_heads: int

    @property
    def n_pages(self) -> int:
        """Block-table entries the kernel reads per batch: ceil(Skv / page)."""
        return math.ceil(self.seqlen_kv / self.page_size)

    def linear(self, k: torch.Tensor, v: torch.Tensor):
        """The cache as ``[NumBlocks, PageSize, Hkv, D]`` (a vectorized cache relaid out: a
        permutation of its elements, so nothing read changes)."""
        return _linear(self.layout, k, v)

    def page_ids(self, n_tiles: int) -> torch.Tensor:
        """[B, n_tiles] int64: the page each KV tile reads, as the kernel's LDS cache holds
        it: the block table's entry below ceil(Skv/64), page 0 for the padding tiles."""
        B = self.block_table.shape[0]
        ids = torch.zeros(B, n_tiles, dtype=torch.int64, device=self.block_table.device)
        n = min(n_tiles, self.n_pages)
        ids[:, :n] = self.block_table[:, :n].long()
        return ids

    def gather(self, k: torch.Tensor, v: torch.Tensor, n_tiles: int):
        """K and V as the kernel's tiles see them, [B, n_tiles * 64, Hkv, D]: tile t is the
        whole page ``page_ids[b, t]``, rows past Skv included (they are masked in S, not
        zeroed in V)."""
        kl, vl = self.linear(k, v)
        ids = self.page_ids(n_tiles).to(kl.device)
        B = ids.shape[0]
        kg = kl[ids].reshape(B, n_tiles * self.page_size, *kl.shape[2:])
        vg = vl[ids].reshape(B, n_tiles * self.page_size, *vl.shape[2:])
        return kg, vg


def _linear(layout, k, v):
    """A cache as ``[NumBlocks, PageSize, Hkv, D]`` (a vectorized cache relaid out: a
    permutation of its elements, so nothing read changes)."""
    if layout == "linear":
        return k, v
    nb, hkv, dvec, ps, kvs = k.shape
    kl = k.permute(0, 3, 1, 2, 4).reshape(nb, ps, hkv, dvec * kvs)
    nb, hkv, pvec, d, kvs = v.shape
    vl = v.permute(0, 2, 4, 1, 3).reshape(nb, pvec * kvs, hkv, d)
    return kl, vl


def _ints(name, x, device):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 (or int64) tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}")


def _cache_shape(name, t, q, layout):
    """(NumBlocks, PageSize, Hkv, D) of one cache tensor in ``layout``, checked."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if layout == "linear":
        if t.dim() != 4:
            raise ValueError(f"paged {name} with kv_cache_layout='linear' must be 4-D [NumBlocks, "
                             f"PageSize, Hkv, D], got shape {tuple(t.shape)}")
        return tuple(t.shape)
    kvs = vector_size(q.dtype)
    if t.dim() != 5 or t.shape[4] != kvs:
        want = ("[NumBlocks, Hkv, D/kVS, PageSize, kVS]" if name == "k"
                else "[NumBlocks, Hkv, PageSize/kVS, D, kVS]")
        raise ValueError(f"paged {name} with kv_cache_layout='vectorized' must be 5-D {want} with "
                         f"kVS={kvs} for {q.dtype}, got shape {tuple(t.shape)}")
    nb, hkv = t.shape[0], t.shape[1]
    if name == "k":
        return nb, t.shape[3], hkv, t.shape[2] * kvs
    return nb, t.shape[2] * kvs, hkv, t.shape[3]


def check(q, k, v, block_table, seqlen_k, kv_cache_layout, *, head_dims) -> PagedKV | None:
    """None when neither ``block_table`` nor ``seqlen_k`` is given; else every paged
    argument checked before any work (ValueError/TypeError naming it) into a ``PagedKV``.
    q is dense ``[B, Sq, H, D]``; its dtype and head dim were checked by the caller."""
    if block_table is None and seqlen_k is None:
        if not isinstance(kv_cache_layout, str) or kv_cache_layout != "linear":
            raise ValueError(f"kv_cache_layout={kv_cache_layout!r} applies to paged calls "
                             "(block_table and seqlen_k) only")
        return None
    if block_table is None or seqlen_k is None:
        missing = "block_table" if block_table is None else "seqlen_k"
        raise ValueError(f"paged KV needs both block_table and seqlen_k; {missing} is missing")
    if not isinstance(kv_cache_layout, str):
        raise TypeError(f"kv_cache_layout must be a str, got {type(kv_cache_layout).__name__}")
    if kv_cache_layout not in LAYOUTS:
        why = (" (upstream documents it, but its paged path refuses it)"
               if kv_cache_layout == "linear3d" else "")
        raise ValueError(f"kv_cache_layout={kv_cache_layout!r} is not supported{why}; the paged "
                         f"kernel takes {LAYOUTS}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"paged q must be dense 4-D [B, Sq, H, D], got {shape}")
    B, Sq, H, D = q.shape
    ks = _cache_shape("k", k, q, kv_cache_layout)
    vs = _cache_shape("v", v, q, kv_cache_layout)
    if ks != vs:
        raise ValueError(f"paged k and v must hold the same cache: k reads as (NumBlocks, PageSize, "
                         f"Hkv, D) = {ks}, v as {vs}")
    nb, page, hkv, dk = ks
    if page not in PAGE_SIZES:
        raise ValueError(f"page size {page} (k's PageSize) is not supported: the paged kernel "
                         f"takes page size {' or '.join(map(str, PAGE_SIZES))}")
    if dk != D:
        raise ValueError(f"paged k head dim {dk} must match q's head dim {D}")
    if head_dims is not None and D not in head_dims:
        raise ValueError(f"head dim D={D} is not supported with paged KV; it takes D in {head_dims}")
    if min(nb, hkv) < 1 or H % hkv:
        raise ValueError(f"paged k has {nb} blocks and {hkv} kv heads; q's H={H} must be a "
                         "multiple of the kv heads and the cache must hold a block")
    _ints("block_table", block_table, q.device)
    _ints("seqlen_k", seqlen_k, q.device)
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be [B={B}, max_pages], got shape {tuple(block_table.shape)}")
    if seqlen_k.dim() != 1 or seqlen_k.shape[0] != B:
        raise ValueError(f"seqlen_k must be [B={B}], got shape {tuple(seqlen_k.shape)}")
    lens = tuple(int(x) for x in seqlen_k.tolist())
    if min(lens) < 0 or max(lens) < 1:
        raise ValueError(f"seqlen_k must be >= 0 with at least one key, got {list(lens)}")
    skv = max(lens)
    n_pages = math.ceil(skv / page)
    if block_table.shape[1] < n_pages:
        raise ValueError(f"block_table has {block_table.shape[1]} pages per row, too short for "
                         f"seqlen_k up to {skv}: the kernel reads ceil({skv}/{page}) = {n_pages}")
    if n_pages > BT_LDS_SIZE:
        raise ValueError(f"seqlen_k up to {skv} needs {n_pages} pages, past the kernel's "
                         f"block-table LDS window of {BT_LDS_SIZE} pages")
    read = block_table[:, :n_pages]
    lo, hi = int(read.min()), int(read.max())
    if lo < 0 or hi >= nb:
        raise ValueError(f"block_table holds block ids in [{lo}, {hi}] among the {n_pages} pages the "
                         f"kernel reads per row, out of range for a cache of {nb} blocks")
    if min(lens) != skv:
        warnings.warn(f"seqlen_k differs across the batch ({min(lens)} .. {skv}): upstream's dense "
                      f"paged kernel receives only max(seqlen_k) = {skv}, so every sequence attends "
                      "to the keys its block table maps up to that length, as modelled here",
                      RaggedSeqlenWarning, stacklevel=caller_stacklevel())
    bt = block_table.to(torch.int32).contiguous()
    return PagedKV(bt, lens, kv_cache_layout, page, skv, nb, hkv)


# ---- paged fp8 prefill (FlyDSL #1066) ---------------------------------------------------

#: The page size the paged fp8 builder takes at 6aeb4321 (page-64 vectorized KV only).
FP8_PAGE_SIZES = (64,)
#: (D, Dv) pairs the paged fp8 interface accepts.
FP8_HEAD_DIMS = ((128, 128), (192, 128), (192, 192))
#: (D, Dv) pairs ``use_bn128`` admits (with an even page count); the rest run per tile.
FP8_BN128_HEAD_DIMS = ((128, 128),)
#: The two kernels of the paged fp8 builder, as ``PagedFp8.schedule`` names them.
FP8_SCHEDULES = ("bn128", "tile")


def fp8_schedule(head_dims: tuple, n_pages: int) -> str:
    """The interface's ``use_bn128``: "bn128" for (128, 128) head dims and an even count
    of pages of the length it sizes the build by, else "tile"."""
    return "bn128" if head_dims in FP8_BN128_HEAD_DIMS and n_pages % 2 == 0 else "tile"


@dataclass(frozen=True)
class PagedFp8:
    """A checked paged fp8 call (packed varlen q): the block table (int32 on q's device),
    ``cu_q`` (host list), each sequence's KV length ``seqlen_k`` (host tuple),
    ``max_seqlen_q``, ``seqlen_kv`` (the length the interface sizes the build by:
    ``max_seqlen_kv``, else max(seqlen_k)), the page size, the cache's block and kv-head
    counts, v's head dim and the kernel the interface picks (``schedule``,
    ``fp8_schedule``)."""

    block_table: torch.Tensor
    cu_q: tuple
    seqlen_k: tuple
    max_seqlen_q: int
    seqlen_kv: int
    page_size: int
    num_blocks: int
    num_kv_heads: int
    head_dim_v: int
    schedule: str = "bn128"
    layout: str = "vectorized"

    @property
    def batch(self) -> int:
        return len(self.seqlen_k)

    def linear(self, k: torch.Tensor, v: torch.Tensor):
        """The cache as ``[NumBlocks, PageSize, Hkv, D]`` (``_linear``)."""
        return _linear(self.layout, k, v)

    def entries_read(self, b: int) -> int:
        """How many leading block-table entries of row ``b`` the kernel reads: BN128 its
        pages rounded up to even (a pair's partner is read with it), at least 2 (padding
        pairs read entries 0 and 1); per tile its pages (padding tiles read
        ``block_table[0, 0]``)."""
        n = math.ceil(self.seqlen_k[b] / self.page_size)
        return max(2, n + n % 2) if self.schedule == "bn128" else n

    def page_ids(self, b: int, n_tiles: int) -> torch.Tensor:
        """[n_tiles] int64: the page sequence ``b``'s KV tile t reads. BN128 (n_tiles even)
        loads the ids of a tile pair (2p, 2p + 1) together, from entries 2p and 2p + 1 of
        the row when 2p < ceil(seqlen_k[b] / 64) (so an odd page count also reads the
        entry after its last page), else from entries 0 and 1. Per tile: entry t of the
        row when t < ceil(seqlen_k[b] / 64), else ``block_table[0, 0]``."""
        n = math.ceil(self.seqlen_k[b] / self.page_size)
        t = torch.arange(n_tiles, device=self.block_table.device)
        if self.schedule == "tile":
            own = self.block_table[b, torch.where(t < n, t, torch.zeros_like(t))]
            return torch.where(t < n, own, self.block_table[0, 0]).long()
        first = t - t % 2
        entry = torch.where(first < n, first, torch.zeros_like(first)) + t % 2
        return self.block_table[b, entry].long()


def _fp8_cache_shape(name, t, q):
    """(NumBlocks, PageSize, Hkv, D) of one vectorized fp8 cache tensor, checked."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != q.dtype:
        raise TypeError(f"paged {name} has dtype {t.dtype} but q has {q.dtype}; all three must match")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    kvs = vector_size(q.dtype)
    if t.dim() != 5 or t.shape[4] != kvs:
        want = ("[NumBlocks, Hkv, D/16, PageSize, 16]" if name == "k"
                else "[NumBlocks, Hkv, PageSize/16, Dv, 16]")
        raise ValueError(f"paged fp8 {name} must be the vectorized 5-D cache {want}, got shape "
                         f"{tuple(t.shape)}")
    if name == "k":
        return t.shape[0], t.shape[3], t.shape[1], t.shape[2] * kvs
    return t.shape[0], t.shape[2] * kvs, t.shape[1], t.shape[3]


def _cu_list(name, x, device) -> list:
    if x is None:
        raise ValueError(f"paged fp8 KV needs {name}: upstream's paged fp8 kernel runs packed "
                         "varlen q only (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q)")
    return cu_seqlens(name, x, None, device)


def check_fp8(q, k, v, *, causal, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
              block_table, seqlen_k, kv_cache_layout) -> PagedFp8:
    """Every argument of a paged fp8 call checked before any work (ValueError/TypeError
    naming it) into a ``PagedFp8``; q is float8_e4m3fn (checked by the caller)."""
    if block_table is None or seqlen_k is None:
        missing = "block_table" if block_table is None else "seqlen_k"
        raise ValueError(f"paged KV needs both block_table and seqlen_k; {missing} is missing")
    if not isinstance(kv_cache_layout, str):
        raise TypeError(f"kv_cache_layout must be a str, got {type(kv_cache_layout).__name__}")
    if kv_cache_layout != "vectorized":
        raise ValueError(f"kv_cache_layout={kv_cache_layout!r}: upstream's paged fp8 kernel takes "
                         "the vectorized cache only (kv_cache_layout='vectorized')")
    if causal is not True:
        raise ValueError(f"causal={causal!r}: upstream's paged fp8 kernel is causal (bottom-right) only")
    if q.dim() != 3:
        raise ValueError(f"paged fp8 q must be packed [total_q, H, D], got shape {tuple(q.shape)}")
    total_q, H, D = q.shape
    cu_q = _cu_list("cu_seqlens_q", cu_seqlens_q, q.device)
    cu_kv = _cu_list("cu_seqlens_kv", cu_seqlens_kv, q.device)
    if cu_q[-1] != total_q:
        raise ValueError(f"cu_seqlens_q ends at {cu_q[-1]} but q has {total_q} packed rows")
    if len(cu_kv) != len(cu_q):
        raise ValueError(f"cu_seqlens_q has {len(cu_q) - 1} sequences but cu_seqlens_kv has "
                         f"{len(cu_kv) - 1}")
    B = len(cu_q) - 1
    lq = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lk = tuple(b - a for a, b in zip(cu_kv, cu_kv[1:]))
    if max_seqlen_q is None:
        raise ValueError("paged fp8 KV needs max_seqlen_q (upstream sizes its grid by it)")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int):
        raise TypeError(f"max_seqlen_q must be an int, got {type(max_seqlen_q).__name__}")
    if max_seqlen_q < max(lq):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is below the longest sequence ({max(lq)} "
                         "rows of cu_seqlens_q): the kernel's grid would skip rows")
    ks = _fp8_cache_shape("k", k, q)
    vs = _fp8_cache_shape("v", v, q)
    nb, page, hkv, dk = ks
    if vs[:3] != ks[:3]:
        raise ValueError(f"paged k and v must hold the same pages: k reads as (NumBlocks, PageSize, "
                         f"Hkv) = {ks[:3]}, v as {vs[:3]}")
    dv = vs[3]
    if page not in FP8_PAGE_SIZES:
        raise ValueError(f"page size {page} (k's PageSize) is not supported: the paged fp8 kernel "
                         f"takes page size {' or '.join(map(str, FP8_PAGE_SIZES))}")
    if dk != D:
        raise ValueError(f"paged k head dim {dk} must match q's head dim {D}")
    if (D, dv) not in FP8_HEAD_DIMS:
        raise ValueError(f"head dims (D, Dv) = ({D}, {dv}) are not supported by the paged fp8 "
                         f"kernel; it takes {FP8_HEAD_DIMS}")
    if min(nb, hkv) < 1 or H % hkv:
        raise ValueError(f"paged k has {nb} blocks and {hkv} kv heads; q's H={H} must be a "
                         "multiple of the kv heads and the cache must hold a block")
    _ints("block_table", block_table, q.device)
    if not isinstance(seqlen_k, torch.Tensor):
        raise TypeError(f"seqlen_k must be a torch.Tensor, got {type(seqlen_k).__name__}")
    if seqlen_k.dtype != torch.int32 or seqlen_k.dim() != 1 or seqlen_k.shape[0] != B:
        raise ValueError(f"paged fp8 seqlen_k must be int32 [B={B}], got {seqlen_k.dtype} of shape "
                         f"{tuple(seqlen_k.shape)}")
    if seqlen_k.device != q.device:
        raise ValueError(f"seqlen_k is on {seqlen_k.device} but q is on {q.device}")
    lens = tuple(int(x) for x in seqlen_k.tolist())
    if lens != lk:
        raise ValueError(f"seqlen_k {list(lens)} differs from the lengths cu_seqlens_kv gives "
                         f"{list(lk)}: the kernel reads cu_seqlens_kv, upstream's interface "
                         "max(seqlen_k); fa_lab refuses rather than pick one")
    if min(lens) < 0 or max(lens) < 1:
        raise ValueError(f"seqlen_k must be >= 0 with at least one key, got {list(lens)}")
    skv = max(lens)
    if max_seqlen_kv is not None:
        if isinstance(max_seqlen_kv, bool) or not isinstance(max_seqlen_kv, int):
            raise TypeError(f"max_seqlen_kv must be an int, got {type(max_seqlen_kv).__name__}")
        if max_seqlen_kv < skv:
            raise ValueError(f"max_seqlen_kv={max_seqlen_kv} is below max(seqlen_k)={skv}")
        skv = max_seqlen_kv
    n_pages = math.ceil(skv / page)
    schedule = fp8_schedule((D, dv), n_pages)
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be [B={B}, max_pages], got shape {tuple(block_table.shape)}")
    if schedule == "bn128" and block_table.shape[1] < n_pages:
        raise ValueError(f"block_table has {block_table.shape[1]} pages per row, too short: the "
                         f"paired-page kernel needs ceil({skv}/{page}) = {n_pages}")
    if schedule == "bn128" and B == 1 and (max_seqlen_q, skv) != (lq[0], lens[0]):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} and the KV length {skv} (max_seqlen_kv, else "
                         f"max(seqlen_k)) must equal the one sequence's {lq[0]} rows and "
                         f"{lens[0]} keys: for one sequence upstream builds the BN128 kernel "
                         "without varlen, which takes them as the lengths, not cu_seqlens")
    own = math.ceil(max(lens) / page)
    if block_table.shape[1] < own:
        raise ValueError(f"block_table has {block_table.shape[1]} pages per row, too short for "
                         f"seqlen_k up to {max(lens)}: the kernel reads ceil({max(lens)}/{page}) = {own}")
    bt = block_table.to(torch.int32).contiguous()
    checked = PagedFp8(bt, tuple(cu_q), lens, max_seqlen_q, skv, page, nb, hkv, dv, schedule)
    why = ("its pages, rounded up to a whole pair" if schedule == "bn128"
           else "its pages, on the per-tile kernel")
    for b in range(B):
        read = block_table[b, :checked.entries_read(b)]
        if read.numel() and (int(read.min()) < 0 or int(read.max()) >= nb):
            raise ValueError(f"block_table row {b} holds block ids in [{int(read.min())}, "
                             f"{int(read.max())}] among the {read.numel()} entries the kernel "
                             f"reads for sequence {b} ({why}), out of range for a cache of "
                             f"{nb} blocks")
    if schedule == "tile" and not 0 <= int(block_table[0, 0]) < nb:
        raise ValueError(f"block_table[0, 0] = {int(block_table[0, 0])} is out of range for a "
                         f"cache of {nb} blocks: the per-tile kernel's padding tiles read it")
    return checked
